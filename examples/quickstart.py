"""featcache in one file: key an image by its content, compute its features once, serve them from
the cache after that, also after a restart. Runs as written after the main command
(`python3 -m pip install torch==2.13.0 -e .`): python3 examples/quickstart.py (GPU if any, else CPU)
"""

import tempfile

import numpy as np
import torch

from featcache import FeatureCache

NAMESPACE, PARAMS = "my-vlm", {"size": 448}  # the model's identity, its preprocessing settings
torch.set_grad_enabled(False)
torch.manual_seed(0)
vision_model = torch.nn.Sequential(  # stands in for your VLM's vision model
    torch.nn.Conv2d(3, 256, kernel_size=14, stride=14), torch.nn.Flatten(2))  # -> [1, 256, 1024]


def preprocess(image: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(image).to(device).permute(2, 0, 1)[None].float() / 255


def photo(seed: int) -> np.ndarray:  # a decoded RGB image (a PIL image or encoded bytes work too)
    return np.random.default_rng(seed).integers(0, 256, (448, 448, 3), dtype=np.uint8)


with tempfile.TemporaryDirectory() as store:  # use a directory of your own: it persists
    # device: "cuda" when available, else "cpu"; sizes as ints or "64MiB"; 0 turns a tier off
    budgets = dict(device_bytes="64MiB", host_bytes="64MiB", disk_bytes="1GiB")
    with FeatureCache(disk_path=store, **budgets) as cache:
        model = vision_model.to(cache.device)
        image = photo(0)
        key = cache.image_key(image, namespace=NAMESPACE, params=PARAMS)

        feats = cache.get(key)  # a tensor on cache.device, or None
        if feats is None:
            feats = model(preprocess(image, cache.device))
            cache.put(key, feats, namespace=NAMESPACE)  # returns at once; host and disk fill
            # in the background (past their queues a write is dropped and counted)

        # the same in one call; concurrent callers of a missing key wait for one computation
        feats = cache.get_or_compute(key, lambda: model(preprocess(image, cache.device)),
                                     namespace=NAMESPACE)

        with cache.lease(key) as leased:  # pinned in the device tier while in use
            print(f"features {tuple(leased.shape)} {leased.dtype} on {leased.device}")

        # a job that fills a store: block=True waits for the disk instead of dropping a write
        for seed in range(1, 9):
            other = photo(seed)
            other_key = cache.image_key(other, namespace=NAMESPACE, params=PARAMS)
            if other_key not in cache:
                cache.put(other_key, model(preprocess(other, cache.device)), namespace=NAMESPACE,
                          block=True)
        cache.flush()  # wait until every write is on disk
        stats = cache.stats()  # per tier: hits, misses, entries, bytes, drops, ...
        print(f"{stats['disk']['entries']} entries on disk, {stats['disk']['drops']} writes dropped")

    with FeatureCache(disk_path=store, **budgets) as cache:  # a restart: the same directory
        again = cache.get(key)  # from the disk tier, checksum verified, bit-identical
        assert again is not None and torch.equal(again.cpu(), feats.cpu())
        print(f"after a restart: {len(cache)} entries on disk, {cache.verify().checked} verified, "
              "the first image's features bit-identical")
