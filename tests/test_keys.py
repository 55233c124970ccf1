import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from featcache import KeyHasher, image_key


def rgb(seed=0, size=(32, 24)):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)


def test_equal_inputs_equal_keys_and_digest_sizes():
    a = rgb()
    assert image_key(a) == image_key(a.copy())
    assert len(image_key(a)) == 32  # blake3 by default
    assert len(image_key(a, algorithm="xxh3_128")) == 16
    assert len(image_key(a, algorithm="blake2b")) == 32
    pil = Image.fromarray(a)
    assert image_key(pil) == image_key(Image.fromarray(a.copy()))


def test_same_key_in_another_process():
    code = (
        "import numpy as np; from featcache import image_key;"
        "a = np.random.default_rng(0).integers(0, 256, size=(24, 32, 3), dtype=np.uint8);"
        "print(image_key(a, namespace='m', params={'b': 1, 'a': [1, 2.5]}).hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == image_key(rgb(), namespace="m", params={"a": [1, 2.5], "b": 1}).hex()


def test_any_change_gives_another_key():
    a = rgb()
    base = image_key(a, namespace="m", params={"max_dynamic_patch": 12})
    b = a.copy()
    b[0, 0, 0] ^= 1
    variants = [
        image_key(b, namespace="m", params={"max_dynamic_patch": 12}),  # one pixel bit
        image_key(a, namespace="m2", params={"max_dynamic_patch": 12}),  # namespace
        image_key(a, namespace="m", params={"max_dynamic_patch": 6}),  # param value
        image_key(a, namespace="m", params={"max_dynamic_patch": 12.0}),  # param type
        image_key(a, namespace="m", params={"max_dynamic_patch": True}),  # bool is not 1
        image_key(a, namespace="m", params={"max_dynamic_patch": 12, "x": None}),  # extra param
        image_key(a.reshape(32, 24, 3), namespace="m", params={"max_dynamic_patch": 12}),  # size
        image_key(Image.fromarray(a), namespace="m", params={"max_dynamic_patch": 12}),  # kind
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_params_order_does_not_matter():
    a = rgb()
    assert image_key(a, params={"a": 1, "b": {"x": 1, "y": 2}}) == image_key(
        a, params={"b": {"y": 2, "x": 1}, "a": 1}
    )


def test_pil_mode_and_palette_are_part_of_the_key():
    a = rgb()
    img = Image.fromarray(a)
    assert image_key(img) != image_key(img.convert("RGBA"))
    p1 = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    p2 = p1.copy()
    palette = p2.getpalette()
    palette[0] = (palette[0] + 1) % 256
    p2.putpalette(palette)
    assert p1.tobytes() == p2.tobytes()  # same indices ...
    assert image_key(p1) != image_key(p2)  # ... different colours


def test_encoded_bytes_are_hashed_as_given():
    import io

    img = Image.fromarray(rgb())
    png, bmp = io.BytesIO(), io.BytesIO()
    img.save(png, format="PNG")
    img.save(bmp, format="BMP")
    assert image_key(png.getvalue()) == image_key(bytearray(png.getvalue()))
    assert image_key(png.getvalue()) != image_key(bmp.getvalue())


@pytest.mark.parametrize("algorithm", ["blake3", "blake2b"])
def test_keyed_mode_depends_on_the_secret(algorithm):
    a = rgb()
    k1 = image_key(a, algorithm=algorithm, secret=b"s" * 32)
    k2 = image_key(a, algorithm=algorithm, secret=b"t" * 32)
    assert len({k1, k2, image_key(a, algorithm=algorithm)}) == 3
    assert KeyHasher(algorithm, b"s" * 32).image_key(a) == k1
    assert KeyHasher(algorithm, b"u" * 20).image_key(a) not in (k1, k2)  # any 16-64 byte secret


def test_the_secret_is_never_shown():
    hasher = KeyHasher("blake3", bytes(range(32)))
    assert bytes(range(32)).hex() not in repr(hasher) and "secret" not in repr(hasher)


@pytest.mark.parametrize(
    "bad, error",
    [
        (np.zeros((4, 4), dtype=np.float32), TypeError),
        (np.zeros((2, 2, 2, 2), dtype=np.uint8), TypeError),
        (np.zeros((0, 4, 3), dtype=np.uint8), ValueError),
        (b"", ValueError),
        ("a path", TypeError),
        (None, TypeError),
    ],
)
def test_bad_images_raise_clear_errors(bad, error):
    with pytest.raises(error):
        image_key(bad)


def test_bad_params_and_settings_raise():
    a = rgb()
    with pytest.raises(TypeError, match="parameter"):
        image_key(a, params={"f": object()})
    with pytest.raises(TypeError, match="names must be str"):
        image_key(a, params={1: 2})
    with pytest.raises(ValueError, match="unknown key algorithm"):
        image_key(a, algorithm="md5")
    with pytest.raises(ValueError, match="keyed MAC"):
        image_key(a, algorithm="xxh3_128", secret=b"s" * 32)
    with pytest.raises(ValueError, match="16 to 64"):
        image_key(a, algorithm="blake2b", secret=b"short")
    with pytest.raises(ValueError, match="16 to 64"):
        image_key(a, secret=b"x" * 65)


def test_images_crafted_to_collide_under_xxh3_get_different_keys_by_default():
    """Issue 26: with xxh3-128, two BMPs differing in a few bytes share a key under a server's
    namespace; the default (blake3, keyed in a cache) gives them different keys."""
    import io

    from _collide import xxh3_twins

    namespace = "InternVLChatModel:" + "0123456789abcdef" * 2  # the shape of a model identity
    a, b = xxh3_twins(namespace, {})
    pa, pb = (Image.open(io.BytesIO(x)) for x in (a, b))
    assert pa.size == pb.size == (64, 64) and pa.tobytes() != pb.tobytes()  # two real images
    assert image_key(a, namespace=namespace, algorithm="xxh3_128") == \
        image_key(b, namespace=namespace, algorithm="xxh3_128")  # the attack works on xxh3
    assert image_key(a, namespace=namespace) != image_key(b, namespace=namespace)
    keyed = KeyHasher("blake3", b"k" * 32)
    assert keyed.image_key(a, namespace=namespace) != keyed.image_key(b, namespace=namespace)
