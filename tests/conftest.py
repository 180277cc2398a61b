"""The test lanes and the model they share.

``make test-fast`` runs ``-m "not slow and not corpus"``: the engine, stages and schemas on tiny or synthetic
inputs, in under a minute. ``make test`` runs everything. A test that loads the real model or runs the CLI end to
end is marked ``@pytest.mark.slow``; two guards here keep the fast lane honest:

- a test that asks for the ``smollm2`` fixture without the mark stops the run at collection;
- in a test without the mark, loading pretrained weights raises, naming the mark to add.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from transformers import PreTrainedModel

# a `docfuse serve` the developer keeps running must not answer the suite's `docfuse ask` subprocesses (it runs the
# code it started with); tests of the server name their own socket and drop this
os.environ["DOCFUSE_SERVER"] = "0"


@pytest.fixture(scope="session")
def smollm2() -> tuple[Any, Any]:
    """(model, tokenizer): the embedded SmolLM2 in fp32 on the CPU, loaded once for every module that reads it.

    Through stages.models.shared_model, so a pipeline run in the same process that asks for the same model gets
    this copy. Tests must leave it as they found it (no pruner, no changed weights); a test that rewires the model
    loads its own.
    """
    from docfuse.runtime.loading import ModelNotFoundError
    from docfuse.stages.models import shared_model

    try:
        return shared_model("default", "float32", "cpu")
    except ModelNotFoundError as exc:  # the embedded model package is not installed
        pytest.skip(str(exc))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items
                if "smollm2" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("these tests load the real model but are not marked @pytest.mark.slow, so the fast "
                                "lane would run them; mark them:\n  " + "\n  ".join(unmarked))


@pytest.fixture(autouse=True)
def _fast_tests_load_no_weights(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside slow tests, loading pretrained weights is an error that names the fix."""
    if request.node.get_closest_marker("slow") is not None:
        return
    nodeid = request.node.nodeid

    def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{nodeid} loads pretrained weights ({cls.__name__}); mark it @pytest.mark.slow, "
                           "or build a tiny model from a config as the fast tests do")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
