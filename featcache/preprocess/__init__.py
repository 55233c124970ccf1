"""Image preprocessing that reproduces a model's own bit for bit, faster: ``resample`` (Pillow's
BICUBIC resize in integer tensor ops, CPU or GPU), ``internvl`` (InternVL's dynamic tiles),
``qwen2vl`` (Qwen2-VL's patches) and ``internvl_hf`` (InternVL-HF's tiles over transformers'
GotOcr2 processor).
Nothing here imports lmdeploy at import time (the ``*_spec`` functions read lmdeploy's model
classes when called); ``featcache.lmdeploy.fastprep`` installs it on lmdeploy's models."""
