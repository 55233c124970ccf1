"""The model-family declarations (``featcache.lmdeploy.families``) against lmdeploy 0.18 and the docs.

- every architecture string lmdeploy 0.18 accepts as a VLM has one support row, and nothing else;
- every declaration names a class lmdeploy's PyTorch engine builds for that architecture (its
  module map), whose vision call is where the declaration says, and whose ``prepare`` reads the
  list the declaration names;
- docs/lmdeploy.md's support table is the one the declarations generate.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re

import _lmdeploy_stack
import pytest

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

from featcache.lmdeploy import families  # noqa: E402
from featcache.lmdeploy.families import SPECS, SUPPORT, support_table  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "lmdeploy.md")
# architecture strings lmdeploy 0.18 recognises by the shape of the config rather than its set
BY_SHAPE = {"DeepseekVLV2ForCausalLM", "MultiModalityCausalLM", "ChatGLMModel",
            "ChatGLMForConditionalGeneration"}


def accepted() -> set[str]:
    """The architecture strings of lmdeploy 0.18's ``check_vl_llm`` (its set, read from the source)."""
    from lmdeploy import archs

    source = inspect.getsource(archs.check_vl_llm)
    listed = set(re.findall(r"'([A-Za-z0-9_]+)'", source.split("supported_archs = set([")[1].split("])")[0]))
    return listed | BY_SHAPE


def test_one_row_per_architecture_lmdeploy_accepts():
    rows = [s.arch for s in SUPPORT]
    assert len(rows) == len(set(rows))
    assert set(rows) == accepted()
    assert len(rows) >= 31


def test_every_declaration_is_a_cached_row_and_every_cached_row_a_declaration():
    assert {s.arch for s in SUPPORT if s.cached} == set(SPECS)
    for row in SUPPORT:
        assert row.note, row.arch  # a reason, or the engines and API


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_a_declaration_names_lmdeploys_class_its_vision_call_and_list(arch):
    from lmdeploy.pytorch.models.module_map import MODULE_MAP

    spec = SPECS[arch]
    module = importlib.import_module(f"lmdeploy.pytorch.models.{spec.module}")
    cls = getattr(module, spec.cls)
    cls = getattr(cls, "__wrapped__", cls)
    # (GLM-4V-9B's config names ChatGLMModel; lmdeploy takes the class its auto_map gives
    # AutoModelForCausalLM, modeling_chatglm.ChatGLMForConditionalGeneration: patch.py)
    mapped = {"ChatGLMModel": "ChatGLMForConditionalGeneration"}.get(arch, arch)
    assert MODULE_MAP[mapped].endswith(f".{spec.module}.{spec.cls}"), MODULE_MAP[mapped]
    prepare = inspect.getsource(cls.prepare_inputs_for_generation)
    assert f"'{spec.items}'" in prepare  # the list its prepare reads
    init = inspect.getsource(cls.__init__) + inspect.getsource(cls.forward)
    if spec.submodule:
        assert f"self.{spec.vision}(" in inspect.getsource(cls.forward) or any(
            f"self.{spec.vision.split('.')[-1]}(" in inspect.getsource(k.forward)
            for k in _modules_of(module)), spec.vision
    else:
        assert callable(getattr(cls, spec.vision)) and f"self.{spec.vision}(" in init
    if spec.output == families.DEEPSTACK:
        assert "deepstack_visual_embeds" in inspect.getsource(cls.forward)
    if spec.frontend == families.PROCESSOR:
        from lmdeploy.vl.model.base import VISION_MODELS

        vl = next(m for m in VISION_MODELS.module_dict.values()
                  if arch in (m._arch if isinstance(m._arch, list) else [m._arch]))
        assert "mm_processor_kwargs" in inspect.signature(vl.preprocess).parameters


def _modules_of(module):
    return [v for v in vars(module).values() if inspect.isclass(v) and hasattr(v, "forward")
            and v.__module__ == module.__name__]


def test_the_docs_table_is_the_generated_one():
    with open(DOCS) as f:
        text = f.read()
    start = text.index("<!-- support-table")
    table = text[text.index("\n", start) + 1:text.index("<!-- /support-table -->")].strip()
    assert table == support_table()
