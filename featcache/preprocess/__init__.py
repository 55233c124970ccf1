"""Image preprocessing that reproduces a model's own bit for bit, faster: ``resample`` (Pillow's
BICUBIC resize in integer tensor ops, CPU or GPU) and ``internvl`` (InternVL's dynamic tiles).
Nothing here imports lmdeploy; ``featcache.lmdeploy.fastprep`` installs it on lmdeploy's models."""
