"""What every exact fast path checks of a vision model before it trusts its own reading of the
model's preprocessing: the model is lmdeploy's class for it with lmdeploy's own ``preprocess``, its
image processor is exactly one of the classes the path reproduces, and none of the processor's
methods the path mirrors is replaced on the instance. (Each path then checks its processor's
settings and compares its output with the processor's own on probe images.)"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any


def processor_classes(pil: str, torchvision_module: str, torchvision_class: str) -> tuple[type, ...]:
    """transformers' PIL image processor ``pil``, and where torchvision imports, its
    torchvision-backed twin (``torchvision_class`` of ``torchvision_module``; without torchvision
    transformers gives a placeholder of that name): the classes a fast path may take, its probes
    deciding whether it reproduces them. ImportError where transformers has no ``pil``."""
    try:
        classes: list[type] = [getattr(importlib.import_module("transformers"), pil)]
    except AttributeError as e:
        raise ImportError(f"transformers has no {pil}") from e
    try:
        import torchvision  # noqa: F401

        classes.append(getattr(importlib.import_module(torchvision_module), torchvision_class))
    except Exception:  # (no torchvision, or one that does not load beside this torch)
        pass
    return tuple(classes)


def image_processor(vision_model: Any, model_class: Any, model_name: str,
                    classes: tuple[type, ...], methods: Iterable[str]) -> Any | str:
    """``vision_model``'s image processor, or why a fast path cannot take it (a sentence)."""
    if not isinstance(vision_model, model_class):
        return f"{type(vision_model).__name__} is not lmdeploy's {model_name} model"
    if type(vision_model).preprocess is not model_class.preprocess:
        return f"{type(vision_model).__name__} has a preprocess of its own"
    ip = getattr(getattr(vision_model, "processor", None), "image_processor", None)
    if ip is None or type(ip) not in classes:
        return (f"its image processor is {type(ip).__name__}, not one of transformers' "
                f"{' or '.join(c.__name__ for c in classes)}")
    patched = [name for name in methods if name in vars(ip)]
    if patched:
        return f"its image processor's {', '.join(patched)} are replaced on the instance"
    return ip
