"""The trust_remote_code files the checkpoint builders write: the config classes of InternVL2
(``InternVLChatConfig``), its InternViT (``InternVisionConfig``) and InternLM2
(``InternLM2Config``), their fields as the hub's files define them (``REMOTE_FILES``: file name ->
source, for bench/device/make_seed_models.py); and stand-ins for GLM-4V-9B's and CogVLM's config
classes (``STANDIN_FILES``, for bench/device/make_tiny_vlm.py and tests/lmdeploy_tiny.py): every
field kept as config.json gives it, ``vision_config`` a dict, as lmdeploy 0.18 reads it. No
modeling code: lmdeploy has its own.
"""

CONFIGURATION_INTERN_VIT = '''"""InternViT configuration (fields as in the hub's configuration_intern_vit.py;
written by featcache's bench/device/make_seed_models.py)."""
from transformers import PretrainedConfig


class InternVisionConfig(PretrainedConfig):
    model_type = "intern_vit_6b"

    def __init__(self, num_channels=3, patch_size=14, image_size=224, qkv_bias=False, hidden_size=3200,
                 num_attention_heads=25, intermediate_size=12800, qk_normalization=True, num_hidden_layers=48,
                 use_flash_attn=True, hidden_act="gelu", norm_type="rms_norm", layer_norm_eps=1e-6,
                 dropout=0.0, drop_path_rate=0.0, attention_dropout=0.0, initializer_range=0.02,
                 initializer_factor=0.1, **kwargs):
        super().__init__(**kwargs)
        self.num_channels = num_channels
        self.patch_size = patch_size
        self.image_size = image_size
        self.qkv_bias = qkv_bias
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.qk_normalization = qk_normalization
        self.num_hidden_layers = num_hidden_layers
        self.use_flash_attn = use_flash_attn
        self.hidden_act = hidden_act
        self.norm_type = norm_type
        self.layer_norm_eps = layer_norm_eps
        self.dropout = dropout
        self.drop_path_rate = drop_path_rate
        self.attention_dropout = attention_dropout
        self.initializer_range = initializer_range
        self.initializer_factor = initializer_factor
'''

CONFIGURATION_INTERNLM2 = '''"""InternLM2 configuration (fields as in the hub's configuration_internlm2.py;
written by featcache's bench/device/make_seed_models.py)."""
from transformers import PretrainedConfig


class InternLM2Config(PretrainedConfig):
    model_type = "internlm2"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=103168, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                 max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, bias=True,
                 rope_theta=10000, rope_scaling=None, attn_implementation="eager", **kwargs):
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.bias = bias
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.attn_implementation = attn_implementation or "eager"
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
'''

CONFIGURATION_INTERNVL_CHAT = '''"""InternVL chat configuration (fields as in the hub's
configuration_internvl_chat.py, for the InternLM2 LLM of InternVL2-2B/-26B; written by featcache's
bench/device/make_seed_models.py)."""
import copy

from transformers import PretrainedConfig

from .configuration_intern_vit import InternVisionConfig
from .configuration_internlm2 import InternLM2Config


class InternVLChatConfig(PretrainedConfig):
    model_type = "internvl_chat"
    is_composition = True

    def __init__(self, vision_config=None, llm_config=None, use_backbone_lora=0, use_llm_lora=0,
                 select_layer=-1, force_image_size=None, downsample_ratio=0.5, template=None,
                 dynamic_image_size=False, use_thumbnail=False, ps_version="v1", min_dynamic_patch=1,
                 max_dynamic_patch=6, **kwargs):
        super().__init__(**kwargs)
        vision_config = dict(vision_config or {})
        llm_config = dict(llm_config or {"architectures": ["InternLM2ForCausalLM"]})
        self.vision_config = InternVisionConfig(**vision_config)
        if llm_config.get("architectures", [None])[0] != "InternLM2ForCausalLM":
            raise ValueError("this configuration knows only InternLM2ForCausalLM: %r"
                             % llm_config.get("architectures"))
        self.llm_config = InternLM2Config(**llm_config)
        self.use_backbone_lora = use_backbone_lora
        self.use_llm_lora = use_llm_lora
        self.select_layer = select_layer
        self.force_image_size = force_image_size
        self.downsample_ratio = downsample_ratio
        self.template = template
        self.dynamic_image_size = dynamic_image_size
        self.use_thumbnail = use_thumbnail
        self.ps_version = ps_version
        self.min_dynamic_patch = min_dynamic_patch
        self.max_dynamic_patch = max_dynamic_patch
        self.tie_word_embeddings = self.llm_config.tie_word_embeddings

    def to_dict(self):
        output = copy.deepcopy(self.__dict__)
        output["vision_config"] = self.vision_config.to_dict()
        output["llm_config"] = self.llm_config.to_dict()
        output["model_type"] = self.__class__.model_type
        return output
'''

REMOTE_FILES = {"configuration_intern_vit.py": CONFIGURATION_INTERN_VIT,
                "configuration_internlm2.py": CONFIGURATION_INTERNLM2,
                "configuration_internvl_chat.py": CONFIGURATION_INTERNVL_CHAT}

STANDIN_CONFIG = '''"""A stand-in for the checkpoint's remote-code config class (written by featcache's
bench/device/make_tiny_vlm.py or tests/lmdeploy_tiny.py): every field kept as config.json gives
it, ``vision_config`` a dict, as lmdeploy 0.18 reads it."""
from transformers import PretrainedConfig


class {name}(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, vision_config=None, **kwargs):
        self.vision_config = vision_config
        super().__init__(**kwargs)
'''

# file name -> (class name, source), as the public checkpoints name them in their auto_map
STANDIN_FILES = {
    "configuration_chatglm.py": ("ChatGLMConfig",
                                 STANDIN_CONFIG.format(name="ChatGLMConfig", model_type="chatglm")),
    "configuration_cogvlm.py": ("CogVLMConfig",
                                STANDIN_CONFIG.format(name="CogVLMConfig", model_type="cogvlm")),
}


def write_standin(out, auto_config):
    """Write into the checkpoint ``out`` the stand-in module its ``auto_map['AutoConfig']``
    (``module.Class``) names."""
    import os
    module, name = auto_config.rsplit('.', 1)
    found, source = STANDIN_FILES[f'{module}.py']
    if found != name:
        raise KeyError(f'no stand-in config class {auto_config}')
    with open(os.path.join(out, f'{module}.py'), 'w') as f:
        f.write(source)
