"""A stand-in for GLM-4V-9B's remote-code config (``configuration_chatglm.ChatGLMConfig``), written
into tests/lmdeploy_tiny.py's tiny GLM-4V checkpoint and named by its ``auto_map``: the fields
lmdeploy 0.18 reads of it (``vision_config`` as a dict: ``image_size``, ``patch_size``), the rest
kept as given."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class ChatGLMConfigStandIn(PretrainedConfig):
    model_type = "chatglm"

    def __init__(self, vision_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.vision_config = vision_config
        super().__init__(**kwargs)
