"""Stand-ins for the remote-code configs of GLM-4V-9B (``configuration_chatglm.ChatGLMConfig``)
and CogVLM (``configuration_cogvlm.CogVLMConfig``), written into tests/lmdeploy_tiny.py's tiny
checkpoints of them and named by their ``auto_map``: the fields lmdeploy 0.18 reads of them
(``vision_config`` as a dict: ``image_size``, ``patch_size``, ``num_positions``), the rest kept as
given."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class ChatGLMConfigStandIn(PretrainedConfig):
    model_type = "chatglm"

    def __init__(self, vision_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.vision_config = vision_config
        super().__init__(**kwargs)


class CogVLMConfigStandIn(ChatGLMConfigStandIn):
    model_type = "cogvlm"
