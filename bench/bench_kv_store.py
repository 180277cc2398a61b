"""The KV store (issue 24): a repeated document's second question against its first, through ``docfuse ask``.

    python bench/bench_kv_store.py [--tokens 7000] [--kv '{}'] [--out kv_store]

``--server``: the first and second runs ask a ``docfuse serve`` started by the bench (the model loaded once), as a
user who keeps one running does; the anchor still runs alone.

Writes a text document of about ``--tokens`` tokens of synthetic contract prose with two facts in it, then runs
``docfuse ask`` on it three times in new processes, each with a fresh stage cache but one KV store: the first run
prefills and stores the document; the second asks another question of the same document (the store's hit); the third
repeats the first run with ``--no-cache`` (no store at all), the anchor in the same session. Reports each run's time
to first token and wall time, and the entry's bytes on disk per token against the raw model-precision K/V.
``--kv`` gives every run the ``kv:`` block (JSON; ``'{}'`` is the tiered cache at its defaults): the store then
keeps the tiered cache's exact core after the prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.common import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCFUSE = Path(sys.executable).parent / "docfuse"
WORDS = ("the party agreement shall notice term fee service provider customer clause section payment invoice period "
         "law court dispute liability indemnity warranty confidential information data security audit report "
         "schedule annex amendment signature effective date renewal termination breach remedy damages cap").split()


def document(path: Path, words: int) -> None:
    rng = random.Random(0)
    sentences, n = [], 0
    while n < words:
        k = rng.randint(8, 20)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        n += k
    sentences.insert(len(sentences) // 3, "The monthly fee is 4,250 euros, due on the first day of each month.")
    sentences.insert(2 * len(sentences) // 3, "This agreement is governed by the laws of the Netherlands.")
    path.write_text("Service Agreement\n\n" + " ".join(sentences))


def ask(path: Path, question: str, cache: Path, *extra: str, env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([str(DOCFUSE), "ask", str(path), question, "--json", "--cache-dir", str(cache),
                          "--max-new-tokens", "24", *extra], capture_output=True, text=True, cwd=ROOT, timeout=1800,
                         env=env)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"question": question, "wall_s": wall, "ttft_s": row["ttft_s"], "prompt_tokens": row["prompt_tokens"],
            "answer": row["answer"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--kv", default=None, help="the kv: block of every run, as JSON (default: none, a full cache)")
    parser.add_argument("--server", action="store_true", help="the first and second runs go through a `docfuse "
                        "serve` started here (its own socket); the anchor runs alone, as without a server")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kv = ("--set", f"answer.kv={args.kv}") if args.kv is not None else ()
    work = Path(tempfile.mkdtemp(prefix="docfuse-kvstore-"))
    doc = work / "agreement.txt"
    document(doc, int(args.tokens * 0.72))  # ~1.4 tokens a word of this vocabulary
    store = work / "kv"
    alone = {**os.environ, "DOCFUSE_SERVER": "0"}
    served, server, ready_s = alone, None, None
    if args.server:
        served = {k: v for k, v in os.environ.items() if k != "DOCFUSE_SERVER"} | {
            "DOCFUSE_SERVER_SOCKET": str(work / "ask.sock")}
        t0 = time.perf_counter()
        server = subprocess.Popen([str(DOCFUSE), "serve", "--idle-minutes", "10"], env=served, cwd=ROOT,
                                  stderr=subprocess.PIPE, text=True)
        server.stderr.readline()  # "docfuse server listening ...": the model is loaded
        ready_s = time.perf_counter() - t0
    try:
        first = ask(doc, "What is the monthly fee?", work / "c1", "--kv-store", str(store), *kv, env=served)
        second = ask(doc, "Which law governs the agreement?", work / "c2", "--kv-store", str(store), *kv, env=served)
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=60)
    anchor = ask(doc, "Which law governs the agreement?", work / "c3", "--no-cache", *kv, env=alone)
    entries = list(store.glob("*.dfkv"))
    # the embedded model in its default dtype (bf16): 30 layers x 3 KV heads x 64 x (K, V) x 2 bytes a token
    raw_per_token = 30 * 3 * 64 * 2 * 2
    tokens = first["prompt_tokens"] - 40  # the question's suffix is not stored; ~40 tokens of it
    disk = sum(p.stat().st_size for p in entries)
    result = {"kv": args.kv, "server": args.server, "server_ready_s": ready_s,
              "runs": {"first": first, "second_from_store": second, "no_store_anchor": anchor},
              "second_over_anchor_wall": second["wall_s"] / anchor["wall_s"],
              "second_over_first_ttft": second["ttft_s"] / first["ttft_s"],
              "second_over_anchor_ttft": second["ttft_s"] / anchor["ttft_s"],
              "second_over_first_wall": second["wall_s"] / first["wall_s"],
              "disk_bytes": disk, "disk_bytes_per_token": disk / tokens,
              "disk_over_raw": disk / tokens / raw_per_token}
    for name, r in result["runs"].items():
        print(f"{name}: TTFT {r['ttft_s']:.2f} s, wall {r['wall_s']:.1f} s, {r['prompt_tokens']} prompt tokens: "
              f"{r['answer'][:60]!r}")
    print(f"second / first: TTFT {result['second_over_first_ttft']:.3f}, wall {result['second_over_first_wall']:.3f}; "
          f"disk {disk / 1e6:.1f} MB, {result['disk_over_raw']:.2f} of the raw bf16 K/V")
    if args.out:
        print("saved", save(args.out, result))


if __name__ == "__main__":
    main()
