"""The remote tier's calls to its Redis/Valkey server (``featcache.tiers.remote``): the redis-py
client a config names (``connect``), made lazily and again after a failure, and every call run
through a circuit breaker (``featcache.tiers.breaker``); for a Redis Cluster, a breaker per node and a
deadline per call. What the tier does with a call (reads, publishes, the key secret, its counts
of hits and publishes) is the tier's; here is only whether a call happened.

Invariants:
- every call goes through a breaker: a failed call (refused, timed out, connection lost) raises
  ``Unavailable``, counted (``errors``, ``timeouts``, ``breaker_skips``), which the tier turns into
  a miss or an unpublished entry; after ``remote_breaker_failures`` in a row the server (a
  cluster's node) is skipped for ``remote_breaker_cooldown_ms``, then one trial call decides.
  redis-py's own retries are off (one attempt per call); its pool reconnects on the next call
  after a lost connection;
- a server's error reply (OOM under ``maxmemory-policy noeviction``, TRYAGAIN) is an error but not
  an outage: the breaker sees a success;
- an outage is logged once, when a breaker opens, and once again when a call succeeds; the URL
  in the logs is the redacted one the tier is given.

A Redis Cluster (``redis-cluster://`` or ``rediss-cluster://``, any node's address) is driven by
redis-py's ``RedisCluster``: it keeps the slot map, follows MOVED (slot map patched, refreshed
after repeated ones) and ASK (the ASKING redirect of a slot being migrated), and refreshes the map
after a lost connection. All of an entry's keys share one hash tag, so every call is one slot's,
on one node. On top of it:
- a breaker per node (``breaker_for``): a primary that is dead, partitioned or failing over costs
  the misses of its own slots, not the whole tier's (a tier-wide breaker opened on a third of the
  calls failing); its key's node is looked up in the client's slot map (no I/O); the tier's own
  ``breaker`` stands for calls whose node is not known (no slot map yet, every node gone);
- a deadline per call (``remote_timeout_ms``): redis-py's cluster client sleeps inside a call
  (250 ms on CLUSTERDOWN, 50 ms steps on TRYAGAIN) and refreshes the slot map inline after a lost
  connection (a connect per node it tries), so its calls run on worker threads and a caller waits
  at most the deadline (then it is a timeout, counted; what the worker still does is discarded:
  the tier assembles reads in the caller, and writes a publish's head only after its chunks' call
  returned in time);
- CLUSTERDOWN and "no node reachable" are outages (the breaker's failures), TRYAGAIN (a multi-key
  read of a slot mid-migration) an error reply that is a miss.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..config import CacheConfig
from .breaker import Breaker

log = logging.getLogger("featcache")

T = TypeVar("T")

CLUSTER_WORKERS = 8  # calls to a cluster in flight at once (each bounded by the deadline)


class Unavailable(Exception):
    """A remote call did not happen or did not complete (breaker open, error, timeout)."""


def connect(config: CacheConfig) -> Any:
    """A redis-py client for ``config.remote_url`` (no I/O here: it connects on first use)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    url = config.remote_url
    assert url is not None
    timeout_s = config.remote_timeout_ms / 1000
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),  # one attempt: the breaker decides when to try again
    }
    tls = {"ssl_ca_certs": config.remote_tls_ca_file, "ssl_certfile": config.remote_tls_cert_file,
           "ssl_keyfile": config.remote_tls_key_file}
    options.update({k: v for k, v in tls.items() if v is not None})
    scheme, _, rest = url.partition("://")
    if scheme.endswith("-cluster"):
        return redis.RedisCluster.from_url(f"{scheme.removesuffix('-cluster')}://{rest}", **options)
    return redis.Redis.from_url(url, **options)


class RemoteCalls:
    """One lazily made redis-py client (``factory()``, again after ``close``) and the breakers its
    calls go through. ``count(name)``: where failed calls are counted (the tier's counters);
    ``on_outage()``: called after each call that failed as an outage (the tier checks its key
    secret sooner: the server may have lost it). ``cluster``: the client is a ``RedisCluster``
    (a breaker per node; calls on worker threads, each abandoned after ``deadline_s``)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        breaker: Breaker,
        *,
        count: Callable[[str], None],
        on_outage: Callable[[], None],
        url_for_logs: str = "remote",
        cluster: bool = False,
        deadline_s: float | None = None,
    ) -> None:
        self._factory = factory
        self._client: Any = None
        self._client_lock = threading.Lock()
        self.breaker = breaker
        self._count = count
        self._on_outage = on_outage
        self._url = url_for_logs
        self._was_open = False
        self._logged_unexpected = False
        self._cluster = cluster
        self._node_breakers: dict[str, Breaker] = {}
        self._said_open: set[int] = set()  # node breakers whose opening was logged
        self._deadline_s = deadline_s
        self._pool = (concurrent.futures.ThreadPoolExecutor(CLUSTER_WORKERS, "featcache-remote")
                      if cluster else None)

    def node_breakers(self) -> list[Breaker]:
        """A cluster's breakers of the nodes called so far (none for one server)."""
        return list(self._node_breakers.values())

    def breaker_for(self, key: str | None) -> Breaker:
        """The breaker of the node that serves ``key``'s slot (a cluster whose slot map is
        known), else the tier's."""
        client = self._client
        if not self._cluster or key is None or client is None:
            return self.breaker
        try:
            name = client.get_node_from_key(key).name
        except Exception:  # no slot map (every node was unreachable at the last refresh)
            return self.breaker
        breaker = self._node_breakers.get(name)
        if breaker is None:
            breaker = self._node_breakers.setdefault(
                name, Breaker(self.breaker.failures, self.breaker.cooldown_s, self.breaker.clock))
        return breaker

    def call(self, op: Callable[[Any], T], key: str | None = None) -> T:
        """Run ``op(client)`` through the breaker of ``key``'s node; raise ``Unavailable``
        (counted) if it did not complete. A server error reply (e.g. OOM under
        ``maxmemory-policy noeviction``, TRYAGAIN) is an error but not an outage: the breaker
        sees a success."""
        import redis
        from redis.exceptions import ClusterDownError, RedisClusterException

        breaker = self.breaker_for(key)
        if not breaker.allow():
            self._count("breaker_skips")
            raise Unavailable
        try:
            result = self._run(op)
        except ClusterDownError as e:  # before ResponseError, its base: the cluster is down
            self._count("errors")
            breaker.failure()
            self._on_outage()
            self._note_state(e, breaker)
            raise Unavailable from e
        except redis.exceptions.ResponseError as e:
            breaker.success()
            self._count("errors")
            log.debug("featcache: remote error reply from %s: %s", self._url, e)
            raise Unavailable from e
        except (redis.exceptions.RedisError, RedisClusterException, OSError) as e:
            self._count("timeouts" if isinstance(e, (redis.exceptions.TimeoutError, TimeoutError))
                        else "errors")
            breaker.failure()
            self._on_outage()
            self._note_state(e, breaker)
            raise Unavailable from e
        except Exception as e:  # anything else the client raises is a miss too, never a failed get
            self._count("errors")
            breaker.failure()
            if not self._logged_unexpected:
                self._logged_unexpected = True
                log.exception("featcache: unexpected error from the remote tier %s (logged once)",
                              self._url)
            raise Unavailable from e
        breaker.success()
        self._note_state(None, breaker)
        return result

    def close(self) -> None:
        """Stop the worker threads (a cluster's) and close the client."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a client whose server is gone may raise; nothing to do
                pass

    def _run(self, op: Callable[[Any], T]) -> T:
        """``op(client)``: here, or (a cluster) on a worker thread, waited for at most the
        deadline (then ``TimeoutError``; the worker's late result is dropped)."""
        if self._pool is None:
            return op(self._connected())
        future = self._pool.submit(lambda: op(self._connected()))
        try:
            return future.result(timeout=self._deadline_s)
        except concurrent.futures.TimeoutError:
            if not future.done():
                future.cancel()
                raise TimeoutError(f"no answer within {self._deadline_s} s") from None
            return future.result()  # done just now: its result or its own error

    def _connected(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def _note_state(self, error: BaseException | None, breaker: Breaker) -> None:
        """Log outages once: when a breaker opens and when a call succeeds again (a cluster's
        node breakers name their node)."""
        is_open = breaker.is_open
        was_open = self._was_open if breaker is self.breaker else id(breaker) in self._said_open
        where = self._url if breaker is self.breaker else f"{self._url} (node {self._node_of(breaker)})"
        if is_open and not was_open:
            log.warning(
                "featcache: remote tier %s unreachable (%s: %s); skipping it for %.1f s at a time "
                "until a call succeeds", where, type(error).__name__, error, breaker.cooldown_s,
            )
        elif error is None and was_open:
            log.warning("featcache: remote tier %s reachable again", where)
        if breaker is self.breaker:
            self._was_open = is_open
        elif is_open:
            self._said_open.add(id(breaker))
        else:
            self._said_open.discard(id(breaker))

    def _node_of(self, breaker: Breaker) -> str:
        return next((name for name, b in self._node_breakers.items() if b is breaker), "?")
