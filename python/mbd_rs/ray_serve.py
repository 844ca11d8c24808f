"""Scale-out on Ray Serve: replicas of the engine behind Ray Serve's HTTP ingress, each serving the same OpenAI
routes as `mbd-rs serve` (`create_app` over its own `Engine`). Needs the [ray] extra (`pip install 'mbd-rs[ray]'`).

    mbd-rs serve --ray --replicas 2                     # a local Ray cluster on this machine, 2 replicas
    mbd-rs serve --ray --autoscale 1:4 --replica-cpus 2  # 1 to 4 replicas by load
    mbd-rs serve --ray --ray-address auto --ray-config deploy.yaml   # join a running cluster (ray start ...)

In Python: `serve.run(mbd_rs.ray_serve.deployment("path/or/org/name", num_replicas=2), route_prefix="/")`.

Each replica holds one engine and batches its own requests (`max_concurrency`); Ray Serve routes a request to a
replica with room (`max_ongoing_requests` = the replica's `max_concurrency` + `max_queue`, so its slots are
Ray's too) and queues the rest at the proxy. A replica that dies takes its requests in flight with it (their
clients get an error or a cut stream, never a hang); Ray Serve stops routing to it and starts a new one. Hub ids
resolve on each replica (its node's Hugging Face cache).
"""
from __future__ import annotations

import os
import time
from typing import Any

from . import _core
from .engine import BATCH_CAPS
from .server import BODY_TIMEOUT, MAX_BODY_BYTES, MAX_PROMPT_TOKENS, REQUEST_TIMEOUT, create_app
from .server.limits import KEEPALIVE

#: The keyword arguments of `deployment` that a --ray-config file may set: its own and Engine.load's load options
#: (the core's LOAD_PARAMS, without the batching caps, which max_concurrency sets).
CONFIG_KEYS = ("num_replicas", "autoscaling", "num_cpus", "num_gpus", "max_concurrency", "max_queue",
               "model_name", "revision", "max_body_bytes", "max_prompt_tokens", "request_timeout",
               "body_timeout", "allowed_hosts", "keepalive") + tuple(
                   k for k in _core.LOAD_PARAMS if k not in BATCH_CAPS)


def _ray() -> Any:
    try:
        import ray  # type: ignore[import-not-found,unused-ignore]
        from ray import serve  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:
        raise ImportError(f"Ray Serve is not installed: pip install 'mbd-rs[ray]' ({e})") from None
    return ray, serve


class _Replica:
    """One replica: an engine and the OpenAI app over it (built by Ray Serve on the replica's process)."""

    def __init__(self, model: str | None, revision: str | None, load: dict[str, Any], app: dict[str, Any]):
        from .engine import Engine
        from .hub import resolve_model_path
        self.engine = Engine.load(resolve_model_path(model, revision), **load)
        self._asgi = create_app(self.engine, **app)

    def __serve_build_asgi_app__(self) -> Any:
        return self._asgi


def model_name_for(model: str | None, model_name: str | None = None) -> str:
    """The model id clients send: `model_name`, else a Hub id as given, else the directory's name."""
    from .hub import DEFAULT_MODEL, is_hub_id
    if model_name:
        return model_name
    if model is not None and is_hub_id(model):
        return model
    return os.path.basename(os.path.normpath(model or DEFAULT_MODEL))


def deployment(model: str | None = None, *, revision: str | None = None, model_name: str | None = None,
               api_key: str | None = None, max_concurrency: int = 4, max_queue: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
               request_timeout: float = REQUEST_TIMEOUT, body_timeout: float = BODY_TIMEOUT,
               allowed_hosts: list[str] | None = None, keepalive: float = KEEPALIVE, num_replicas: int = 1,
               autoscaling: dict[str, Any] | None = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
               **load: Any) -> Any:
    """A Ray Serve application of `num_replicas` engine replicas (or `autoscaling`: Ray Serve's
    autoscaling_config, e.g. {"min_replicas": 1, "max_replicas": 4}), each with `num_cpus` / `num_gpus` Ray
    resources, serving the OpenAI routes of `mbd-rs serve` for `model` (a directory every node can read, or a Hub
    id). `load`: Engine.load's options (device, dtype, quantize, ...: the core's LOAD_PARAMS), checked when a
    replica loads. `max_prompt_tokens`, `request_timeout`, `body_timeout`, `allowed_hosts` (None: any Host) and
    `keepalive` are create_app's. Run it with `ray.serve.run(app, route_prefix="/")`."""
    _, serve = _ray()
    queue = max_concurrency if max_queue is None else max_queue
    opts: dict[str, Any] = dict(name="mbd-rs", max_ongoing_requests=max_concurrency + queue,
                                ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})
    if autoscaling is not None:
        opts["autoscaling_config"] = dict(autoscaling)
    else:
        opts["num_replicas"] = num_replicas
    cls = serve.deployment(**opts)(serve.ingress()(_Replica))
    app = dict(model_name=model_name_for(model, model_name), api_key=api_key, max_concurrency=max_concurrency,
               max_queue=queue, max_body_bytes=max_body_bytes, max_prompt_tokens=max_prompt_tokens,
               request_timeout=request_timeout, body_timeout=body_timeout, allowed_hosts=allowed_hosts,
               keepalive=keepalive)
    return cls.bind(model, revision, load, app)


def _read_config(path: str) -> dict[str, Any]:
    """A --ray-config file: YAML or JSON mapping of CONFIG_KEYS."""
    import yaml  # type: ignore[import-untyped,import-not-found,unused-ignore]  # a dependency of Ray
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a Ray config must be a mapping of {', '.join(CONFIG_KEYS)}")
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; valid: {', '.join(CONFIG_KEYS)}")
    return cfg


def serve_ray(args: Any, load: dict[str, Any]) -> int:
    """`mbd-rs serve --ray`: start (or join, --ray-address) a Ray cluster, deploy the replicas behind Ray Serve's
    HTTP proxy on --host/--port, and wait until interrupted. `load`: Engine.load's options from the flags."""
    from .server.net import allowed_hosts
    ray, serve = _ray()
    kw: dict[str, Any] = dict(revision=args.revision, **load, model_name=args.model_name,
                              api_key=args.api_key,
                              max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                              max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                              request_timeout=args.request_timeout, body_timeout=args.body_timeout,
                              keepalive=args.sse_keepalive, allowed_hosts=allowed_hosts(args.host, args.allowed_hosts or []),
                              num_replicas=args.replicas,
                              num_cpus=args.replica_cpus, num_gpus=args.replica_gpus)
    if args.autoscale:
        lo, hi = args.autoscale
        kw["autoscaling"] = {"min_replicas": lo, "max_replicas": hi}
    if args.ray_config:
        for k, v in _read_config(args.ray_config).items():
            kw[k] = v
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="WARNING")
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(deployment(args.model, **kw), name="mbd-rs", route_prefix="/")
    n = kw.get("autoscaling") or kw["num_replicas"]
    print(f"mbd-rs: serving {args.model or 'the embedded model'} as '{model_name_for(args.model, kw['model_name'])}' "
          f"on http://{args.host}:{args.port}/v1 with Ray Serve ({n} replicas)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0
