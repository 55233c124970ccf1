"""The commands that run a model: ``serve`` (lmdeploy's api_server with featcache) and ``warm``
(features of image files computed into the disk tier ahead of serving). Both need lmdeploy; the
work is ``featcache.server.serve``'s and ``featcache.warm``'s, the parsing and printing are here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from ..config import (
    AUTO_BUDGETS,
    BUDGETS,
    DEFAULTS,
    ENGINE_PROCESSES,
    EVICTIONS,
    ID_MODES,
    KEY_ALGORITHMS,
    MEDIA_DEFAULTS,
    REPORTS,
    SERVING_BUDGETS,
    SERVING_BUDGETS_DEFAULT,
    STORE_DIR_HELP,
    VIDEO_OPTIONS,
)
from ..errors import FeatCacheError
from ..sizes import parse_bytes
from ..warm import (
    BACKENDS,
    IMAGE_SUFFIXES,
    TURBOMIND_PATHS,
    collect,
    config_problem,
    loading,
    model_error,
    parse_params,
)
from .command import EXIT_BAD, EXIT_ERROR, EXIT_OK, Command, Parser, at_least_one, json_argument
from .progress import ProgressBar
from .videoflags import VIDEO_FLAGS, shown_default, video_limits


def _bytes(text: str) -> int:
    if text.strip().lower() == "auto":
        raise argparse.ArgumentTypeError("'auto' is not a size: --budgets auto sizes every tier "
                                         "not given from the machine (a size given beside it is kept)")
    try:
        return parse_bytes(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget_help(name: str) -> str:
    """``name``'s default, as ``featcache.lmdeploy.default_cache()`` sizes it, for a help text."""
    return str(SERVING_BUDGETS[name]).replace("%", "%%")  # (argparse formats help with %)


# -- what running a model needs ----------------------------------------------------------------------
def cuda_problem() -> str | None:
    """Why lmdeploy's engines cannot run here (no CUDA device), or None."""
    import torch

    if torch.cuda.is_available():
        return None
    why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
    return (f"this command needs a CUDA GPU ({why}: torch {torch.__version__}); "
            "`featcache demo` runs on the CPU")


HUB_PROBE_TIMEOUT_S = 5.0  # the hub's answer to "is there such a model", before an engine is built


def model_problem(model: str) -> str | None:
    """Why ``model`` (a directory, or a Hugging Face hub id as lmdeploy takes) cannot be loaded,
    or None: a missing directory, a directory with no readable ``config.json``, a name that is no
    hub id, a hub id neither cached nor reachable."""
    if os.path.isdir(model):
        return config_problem(model)
    if os.path.exists(model):
        return f"{model!r} is not a model directory"
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return f"no such model directory: {model!r}"
    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return None
    try:  # one request, no retries: offline is said in seconds (the download itself is lmdeploy's)
        get_hf_file_metadata(hf_hub_url(model, "config.json"), timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 (a probe: offline, no such repo, gated, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (f"cannot get the model {model!r} from the Hugging Face hub ({type(e).__name__}"
                f"{': ' + first if first else ''}); pass a local model directory")
    return None


def arch_problem(model: str, trust_remote_code: bool, backend: str | None = None) -> str | None:
    """Why lmdeploy cannot tell what ``model`` is (its config names no architecture it knows), or,
    with ``backend`` (warm: a vision model is all there is to warm), why it is no vision-language
    model lmdeploy runs on ``backend``; None if neither. lmdeploy's own reading of the config
    (``get_model_arch``, ``check_vl_llm``), before any cache or engine is built."""
    logging.disable(logging.WARNING)  # transformers' and lmdeploy's import-time notes
    try:
        from lmdeploy.archs import check_vl_llm, get_model_arch

        arch, config = get_model_arch(model, trust_remote_code=trust_remote_code)
    except ImportError:
        raise  # a missing extra: said as such (``featcache.cli.run``)
    except Exception as e:  # noqa: BLE001 (a config lmdeploy cannot read: said in one line)
        return model_error(model, e)
    finally:
        logging.disable(logging.NOTSET)
    if backend is None:
        return None
    try:
        vlm = check_vl_llm(backend, config.to_dict())
    except Exception:  # noqa: BLE001 (no "architectures": lmdeploy's pipeline cannot tell either)
        vlm = False
    if not vlm:
        return (f"cannot load the model {model!r}: it is not a vision-language model lmdeploy 0.18 "
                f"runs (architecture {arch}): there are no image features to warm")
    return None


def _remote_code(model: str) -> bool:
    """Whether the checkpoint brings its own config classes (``auto_map``: legacy InternVL2), as
    the TurboMind prompt path and lmdeploy's pipeline then trust them."""
    try:
        with open(os.path.join(model, "config.json"), "rb") as f:
            return "auto_map" in json.loads(f.read())
    except (OSError, ValueError, TypeError):
        return False


# -- serve -------------------------------------------------------------------------------------------
def _serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("featcache options (the rest are lmdeploy's, listed below)")
    g.add_argument("--cache-dir", metavar="DIR", help=f"store directory (default: {STORE_DIR_HELP})")
    for tier in ("device", "host", "disk"):
        g.add_argument(f"--{tier}-bytes", type=_bytes, metavar="N",
                       help=f"{tier} tier budget, e.g. 2GiB (default: {_budget_help(f'{tier}_bytes')})")
    g.add_argument("--budgets", choices=BUDGETS, default=None,
                   help=f"how the tiers not given a size are sized: 'share', fixed shares of the "
                   f"machine as above (the default), or 'auto', from what is free: the device tier "
                   f"{AUTO_BUDGETS['device_bytes']}, the host tier {AUTO_BUDGETS['host_bytes']}, "
                   f"the disk {AUTO_BUDGETS['disk_bytes']}. Each process that holds a cache prints "
                   "what it chose and why when it starts (docs/tuning.md)".replace("%", "%%"))
    g.add_argument("--eviction", choices=EVICTIONS, default=None,
                   help=f"what the device and host tiers evict when full: 'admit', the entries "
                   f"whose hits save the least vision time per byte (GreedyDual over each entry's "
                   f"measured cost) behind an admission filter that is on only while it pays; "
                   f"'value', the same weighed by uses too (GreedyDual-Size-Frequency, no filter); "
                   f"'lru', the least recently used. Default: {DEFAULTS['eviction']} "
                   f"(docs/tuning.md)")
    g.add_argument("--remote-url", metavar="URL",
                   help="a shared remote tier: redis://[:password@]host:6379/0, rediss://..., "
                   "redis-cluster://node:port (default: none; docs/tuning.md)")
    g.add_argument("--namespace", metavar="NS",
                   help="key namespace (default: derived from the model, its dtype and version)")
    g.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="let requests name image files (a path or file:// URL) under DIR, as "
                   "vLLM's option of this name; regular files only, no link out of DIR. Default: "
                   "no local files (images come as data URLs or http(s) URLs); the fast path for "
                   "images on the server's disk needs it (docs/cli.md)")
    g.add_argument("--max-image-bytes", type=_bytes, metavar="N",
                   help="the most bytes read of one image a request names (a file, a data URL, an "
                   "http body), e.g. 32MiB; larger ones are answered 400 (default: "
                   f"{MEDIA_DEFAULTS['max_image_bytes']})")
    for name, kind, what in VIDEO_FLAGS:  # (a video past one is answered 400 naming it)
        g.add_argument(VIDEO_OPTIONS[name], dest=name, type=kind, metavar="N",
                       help=f"{what} (default: {shown_default(name)}); larger ones are answered 400")
    g.add_argument("--engine-process", choices=ENGINE_PROCESSES, default=None,
                   help="where the PyTorch engine runs: 'mp', lmdeploy's own engine process (the "
                   "default, as lmdeploy serve api_server runs it), or 'in' the server's process "
                   "(the default with --trust-client-image-ids). A resent image skips decoding, "
                   "preprocessing and the vision model in both; --tp > 1 works with both "
                   "(docs/multi-gpu.md)")
    g.add_argument("--turbomind", choices=TURBOMIND_PATHS, default=TURBOMIND_PATHS[0],
                   help="with the TurboMind backend, featcache's path: 'native' (engine-ready "
                   "pixels, TurboMind's own vision model; the default), 'features' or 'combined' "
                   "(InternVL: vision features, and for combined pixels too, routed per request; "
                   "featcache's Python vision tower runs on the GPU beside TurboMind's). Refused "
                   "on the PyTorch engine and for models the features path cannot serve "
                   "(docs/turbomind.md)")
    g.add_argument("--trust-client-image-ids", nargs="?", const="on", choices=ID_MODES,
                   default=None, metavar="verify",
                   help="honour the ids clients give their images (\"uuid\" beside image_url), so a "
                   "later request may send the id without the image. Only when every client may "
                   "read every other client's images: an id is all it takes. An id sent again "
                   "with other bytes keeps its first image's features; with 'verify', an image "
                   "sent with an id is served from its own bytes, and the id alone names the first "
                   "image it came with (docs/cli.md)")
    g.add_argument("--featcache-report", choices=REPORTS, default=REPORTS[0],
                   help="what each response says of what its request got from the cache: "
                   "'header' (the default), an X-Featcache header (images, hits, their tiers, the "
                   "vision time saved); 'usage', also a 'featcache' object in a chat completion's "
                   "usage (streamed: in the final usage chunk, with stream_options.include_usage); "
                   "'off', nothing (docs/cli.md)")
    g.add_argument("--key-secret-file", metavar="FILE",
                   help="the file of the secret keys are made with (hex; created if missing). "
                   "Default: the remote tier's (--remote-url), else the store's, made at first "
                   "use; processes that share a store agree on it (docs/design.md, Keys)")
    g.add_argument("--key-algorithm", choices=KEY_ALGORITHMS, default=None,
                   help="the keys' digest: blake3 (keyed, the default) or xxh3_128 (faster, "
                   "unkeyed: a client able to craft colliding images can change another's "
                   "answer; only for a single trusted tenant)")


# what a GPU machine installs to serve (lmdeploy 0.18 takes torch <= 2.12.1)
INSTALL_TO_SERVE = "pip install 'torch<=2.12.1' 'featcache[lmdeploy]'"


def featcache_parser() -> Parser:
    """The ``serve`` command's parser alone, built as the table builds it (for its help text)."""
    parser = Parser(prog="featcache serve", **SERVE.parser_options())
    SERVE.add_arguments(parser)
    return parser


def _serve(args: argparse.Namespace) -> int:
    rest = args.rest  # lmdeploy's options, in order
    if not rest:  # argparse's way: the usage line, then one line saying what is wrong
        print(featcache_parser().format_usage().rstrip(), file=sys.stderr)
        print("featcache serve: error: MODEL is missing: give a model directory or a Hugging Face "
              "hub id (featcache serve --help lists the options)", file=sys.stderr)
        return EXIT_BAD
    if "-h" in rest or "--help" in rest:
        logging.disable(logging.WARNING)  # lmdeploy logs warnings as it imports (optional modules)
        try:
            from ..server.serve import lmdeploy_parser

            parser = lmdeploy_parser()
        except ModuleNotFoundError as e:  # featcache's own options all the same, and what to install
            if (e.name or "").partition(".")[0] not in ("lmdeploy", "huggingface_hub", "transformers"):
                raise
            parser = None
        finally:
            logging.disable(logging.NOTSET)
        featcache_parser().print_help()
        if parser is None:
            print(f"\nlmdeploy serve api_server options: not shown, lmdeploy is not installed. To serve, "
                  f"on a GPU machine: {INSTALL_TO_SERVE} (docs/serving.md)")
            return EXIT_OK
        print("\nlmdeploy serve api_server options:\n")
        parser.print_help()
        return EXIT_OK
    why = cuda_problem()  # before lmdeploy's parser, whose import logs warnings
    if why:
        print(f"featcache serve: error: {why}", file=sys.stderr)
        return EXIT_ERROR
    from ..lmdeploy import counters_cache, default_cache  # lmdeploy: only when serving
    from ..server.serve import (
        backend_of,
        caveat,
        engine_process_for,
        lmdeploy_parser,
        multi_process_args,
        refusal,
        run_server,
        turbomind_refusal,
    )

    lmdeploy_args = lmdeploy_parser().parse_args(rest)
    why = refusal(lmdeploy_args)
    if why:
        print(f"featcache serve: error: {why}", file=sys.stderr)
        return EXIT_BAD
    from ..lmdeploy.request.media import MediaPolicy

    try:
        media = MediaPolicy.create(args.allowed_local_media_path, args.max_image_bytes, video_limits(args))
    except (TypeError, ValueError) as e:  # not a directory, a cap of 0
        print(f"featcache serve: error: {e}", file=sys.stderr)
        return EXIT_BAD
    why = (model_problem(lmdeploy_args.model_path)
           or arch_problem(lmdeploy_args.model_path, lmdeploy_args.trust_remote_code))
    if why:
        print(f"featcache serve: error: {why}", file=sys.stderr)
        return EXIT_ERROR
    with loading(lmdeploy_args.model_path):  # a config lmdeploy cannot judge: one line
        backend = backend_of(lmdeploy_args)
    why = turbomind_refusal(args.turbomind, backend, lmdeploy_args)
    if why:  # before the engine is built: at start, not at the first request
        print(f"featcache serve: error: {why}", file=sys.stderr)
        return EXIT_BAD
    if args.turbomind != TURBOMIND_PATHS[0]:
        print(f"featcache serve: TurboMind {args.turbomind} path: featcache's vision tower runs "
              "in Python on the GPU, beside TurboMind's own (docs/turbomind.md)", file=sys.stderr)
    note = caveat(lmdeploy_args, backend)
    if note:
        print(f"featcache serve: warning: {note}", file=sys.stderr)
    trust_ids: bool | str = {None: False, "on": True}.get(args.trust_client_image_ids,
                                                            args.trust_client_image_ids)
    engine_process = args.engine_process or engine_process_for(bool(trust_ids))
    sizes = dict(path=args.cache_dir, device_bytes=args.device_bytes, host_bytes=args.host_bytes,
                 disk_bytes=args.disk_bytes, remote_url=args.remote_url,
                 key_algorithm=args.key_algorithm, key_secret_file=args.key_secret_file)
    for option in ("budgets", "eviction"):  # left out when not given: the defaults apply
        if getattr(args, option) is not None:
            sizes[option] = getattr(args, option)
    model_cache = None
    try:
        if multi_process_args(lmdeploy_args, backend, engine_process):
            # the model processes build their caches (sized there); this one only counts
            model_cache = {"default_cache": sizes}
            cache = counters_cache()
            print(f"featcache serve: budgets {args.budgets or SERVING_BUDGETS_DEFAULT}: decided by "
                  "each model process once its engine has reserved its KV cache (it prints them "
                  "at its first image)", file=sys.stderr)
        else:  # the engine runs here: with "auto" (PyTorch) the cache is sized once it is built
            cache = default_cache(**sizes,  # type: ignore[arg-type]
                                  host_only=backend == "turbomind",  # TurboMind: host tensors
                                  before_engine=True, announce=_announce)
    except (FeatCacheError, TypeError, ValueError) as e:  # e.g. a --disk-bytes it cannot map
        print(f"featcache serve: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    try:
        run_server(lmdeploy_args, cache, args.namespace, trust_ids, engine_process, model_cache,
                   media, args.featcache_report, turbomind=args.turbomind)
    finally:
        from ..server.shutdown import close_reporting

        print(close_reporting(cache), file=sys.stderr, flush=True)  # the last line: flushed
    return EXIT_OK


def _announce(line: str) -> None:
    """The server's start-up line on its cache's budgets (what each tier got and why)."""
    print(f"featcache serve: {line}", file=sys.stderr, flush=True)


SERVE = Command(
    "serve", help="lmdeploy's OpenAI-compatible server with featcache wrapped in",
    description="lmdeploy's api_server (its flags, endpoints and behaviour) with featcache; "
    "`featcache serve --help` lists both sets of options. See docs/cli.md.",
    add_arguments=_serve_arguments, run=_serve, takes_rest=True,
    usage="featcache serve MODEL [featcache options] [lmdeploy serve api_server options]",
)


# -- warm --------------------------------------------------------------------------------------------
def _warm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="model path or id (as for lmdeploy)")
    p.add_argument("images", nargs="*", metavar="IMAGE", help="image files")
    p.add_argument("--from-dir", metavar="DIR",
                   help=f"also every image file under DIR, recursively ({', '.join(IMAGE_SUFFIXES)})")
    p.add_argument("--cache-dir", metavar="DIR", help=f"store directory (default: {STORE_DIR_HELP})")
    p.add_argument("--disk-bytes", metavar="N",
                   help=f"disk tier budget, e.g. 64GiB (default: {_budget_help('disk_bytes')})")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a per-image parameter the server's clients send too (e.g. "
                   "max_dynamic_patch=6); part of the key. Repeatable")
    p.add_argument("--dtype", default="auto", help="as the server's --dtype (default auto)")
    p.add_argument("--batch", type=at_least_one, default=8, metavar="N",
                   help="images per batch (default 8)")
    p.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0],
                   help="the server's engine: pytorch (features, through lmdeploy's PyTorch engine: "
                   "needs a GPU; the default) or turbomind (what --turbomind serves; no engine built)")
    p.add_argument("--turbomind", choices=TURBOMIND_PATHS, default=TURBOMIND_PATHS[0],
                   help="with --backend turbomind, the server's path: native (engine-ready pixels: "
                   "no GPU needed; the default), features or combined (vision features, and for "
                   "combined pixels too: the vision tower runs on the GPU, else slowly on the CPU)")
    json_argument(p, "print the report as one JSON object (no progress bar; failures in it)")


def _warm(args: argparse.Namespace) -> int:
    try:
        paths = collect(args.images, args.from_dir)
        params = parse_params(args.param)
        disk_bytes = parse_bytes(args.disk_bytes) if args.disk_bytes else None
    except ValueError as e:
        print(f"featcache warm: error: {e}", file=sys.stderr)
        return EXIT_BAD
    if not paths:
        print("featcache warm: error: no images (give IMAGE files or --from-dir DIR)", file=sys.stderr)
        return EXIT_BAD
    from ..config import default_store_dir
    from ..store.files import cannot_create

    store = args.cache_dir or default_store_dir()
    why = cannot_create(store)  # (before anything else is said of the store, its secret included)
    if why:
        print(f"featcache warm: error: the store directory {store} {why}", file=sys.stderr)
        return EXIT_ERROR
    # The GPU first, as serve does: without one, nothing else matters, and the model's probe
    # may spend half a minute retrying the hub (issue 29 item 3). TurboMind: no engine is built.
    turbomind = args.backend == "turbomind"
    why = cuda_problem()
    if why and not turbomind:
        print(f"featcache warm: error: {why}", file=sys.stderr)
        return EXIT_ERROR
    if why and args.turbomind != "native":
        print(f"featcache warm: no CUDA GPU: {args.turbomind} needs the vision tower, which runs "
              "on the CPU here (correct, slow; InternVL2-26B's InternViT-6B needs the GPU)",
              file=sys.stderr)
    from ..lmdeploy import default_cache  # lmdeploy: only when warming
    from ..warm import warm_images

    why = model_problem(args.model) or arch_problem(args.model, _remote_code(args.model),
                                                    args.backend)
    if why:
        print(f"featcache warm: error: {why}", file=sys.stderr)
        return EXIT_ERROR
    try:
        cache = (default_cache(path=args.cache_dir, disk_bytes=disk_bytes, host_only=True)
                 if turbomind else default_cache(path=args.cache_dir, disk_bytes=disk_bytes))
    except (FeatCacheError, TypeError, ValueError) as e:  # e.g. a --disk-bytes it cannot map
        print(f"featcache warm: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    bar = None if args.json else ProgressBar(len(paths), "warm")
    try:
        report = warm_images(args.model, cache, paths, params=params, dtype=args.dtype,
                             batch=args.batch, progress=bar.update if bar else None,
                             backend=args.backend, turbomind=args.turbomind)
    finally:
        cache.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
        return EXIT_ERROR if report.failed else EXIT_OK
    assert bar is not None
    bar.close(report.images, report.image_bytes)
    print(f"warmed {report.images - len(report.failed)} of {report.images} images in "
          f"{report.seconds:.1f} s: {report.computed} computed, {report.cached} already cached"
          + (f", the vision tower over {report.vision_images}" if report.vision_images else "")
          + f"; store: {report.entries} entries, {report.bytes / 2**20:.1f} MiB")
    for line in report.failed:
        print(f"featcache warm: failed: {line}", file=sys.stderr)
    return EXIT_ERROR if report.failed else EXIT_OK


WARM = Command(
    "warm", help="compute features of image files into the disk tier (PyTorch engine: needs a GPU)",
    description="Run MODEL's vision model (a featcache pipeline, lmdeploy's PyTorch engine) "
    "over image files so a server over the same store starts hot; --backend turbomind fills what "
    "a TurboMind path serves instead (--turbomind). Exit code 1 if some images failed (listed on "
    "stderr).",
    add_arguments=_warm_arguments, run=_warm,
)
