"""A real Redis Cluster on loopback for the fleet tests (tests/test_fleet_cluster*.py), and the
TCP proxy that makes one of its nodes unreachable.

``RedisCluster`` starts ``primaries`` x (1 + ``replicas``) redis-server processes in cluster mode
and joins them with ``redis-cli --cluster create``. Every node announces the port of its own
``TcpProxy`` (``cluster-announce-port``), so every client connection to a node, the cluster's
own MIGRATE and replication links included, passes through a proxy the test controls; the
cluster bus (gossip, failure detection) does not, so a blackholed proxy is a partition between
the clients and one node that the cluster itself does not see. Nodes keep ``nodes.conf`` in the
work dir, so a killed node started again rejoins with its identity (its data is gone: no
persistence). ``cluster-require-full-coverage no``: a shard that is down costs only its own slots.

Every process started here is killed by ``close()`` (the fixtures call it in their finalizer).
"""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import _redis
except ImportError:  # tests/ became a package
    from tests import _redis

NODE_TIMEOUT_MS = 1000  # failure detection: a dead primary is replaced ~2-3 s after it dies


def cli_binary() -> str:
    """redis-cli next to the server (or on PATH), or skip (fail when required, as the server)."""
    server = _redis.redis_binary()
    near = Path(server).resolve().parent / "redis-cli"
    path = str(near) if near.exists() else shutil.which("redis-cli")
    if path and os.access(path, os.X_OK):
        return path
    why = "redis-cli is not installed (apt-get install redis-tools)"
    if os.environ.get(_redis.REQUIRE_ENV) == "1":
        pytest.fail(f"{why}, and {_redis.REQUIRE_ENV}=1 asks for the remote-tier tests to run")
    pytest.skip(why)


# -- the proxy -----------------------------------------------------------------------------------
class TcpProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target`` (threads, one per connection).

    ``blackhole()``: every byte either way is dropped from then on, new connections are accepted
    and never answered (a partition: clients time out, nothing is refused); ``heal()`` forwards
    again and resets the connections that lived through the blackhole (as a real partition's
    connections end up reset). ``refuse()``: connections are reset and new ones refused.
    """

    def __init__(self, target: int, port: int | None = None) -> None:
        self.target = target
        self.port = port or _redis.free_port()
        self.mode = "pass"
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._listen()
        self._thread = threading.Thread(target=self._accept_loop, name=f"proxy-{self.port}",
                                        daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(128)
        s.settimeout(0.05)
        self._listener = s

    def blackhole(self) -> None:
        with self._lock:
            self.mode = "blackhole"
            for c in self._conns:
                c.poisoned = True

    def refuse(self) -> None:
        with self._lock:
            self.mode = "refuse"
            conns, self._conns = self._conns, set()
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for c in conns:
            c.close(reset=True)

    def heal(self) -> None:
        with self._lock:
            poisoned = [c for c in self._conns if c.poisoned]
            self._conns.difference_update(poisoned)
            was, self.mode = self.mode, "pass"
        for c in poisoned:
            c.close(reset=True)
        if was == "refuse":
            self._listen()

    def close(self) -> None:
        self._stop.set()
        self.refuse()
        self._thread.join(5)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            listener = self._listener
            if listener is None:
                time.sleep(0.02)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, client)
            with self._lock:
                if self.mode == "refuse":
                    conn.close(reset=True)
                    continue
                self._conns.add(conn)
                conn.poisoned = self.mode == "blackhole"
            threading.Thread(target=conn.run, name=f"proxy-{self.port}-conn", daemon=True).start()

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)


@dataclass(eq=False)
class _Conn:
    proxy: TcpProxy
    client: socket.socket
    upstream: socket.socket | None = None
    poisoned: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            if not self.poisoned:
                try:
                    self.upstream = socket.create_connection(("127.0.0.1", self.proxy.target), timeout=2)
                    self.upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    return
                sel.register(self.upstream, selectors.EVENT_READ, self.client)
            sel.register(self.client, selectors.EVENT_READ, self.upstream)
            while not self.closed:
                for key, _ in sel.select(0.1):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        data = src.recv(1 << 16)
                    except OSError:
                        return
                    if not data:
                        return
                    dst = key.data
                    if self.poisoned or dst is None:
                        continue  # the blackhole: dropped
                    try:
                        dst.sendall(data)
                    except OSError:
                        return
        except (OSError, ValueError):
            return
        finally:
            sel.close()
            self.close(reset=False)
            self.proxy._forget(self)

    def close(self, reset: bool) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.upstream):
            if s is None:
                continue
            try:
                if reset:  # RST, not FIN: what a dead or partitioned peer's connection ends in
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                s.close()
            except OSError:
                pass


# -- the cluster ---------------------------------------------------------------------------------
class PortTaken(RuntimeError):
    """A node's port or bus port was bound by another process before the node bound it
    (``_redis.port_taken``)."""


@dataclass(eq=False)
class Node:
    port: int  # where redis-server listens
    bus_port: int
    proxy: TcpProxy | None  # what it announces: every client goes through here (if any)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.proxy.port if self.proxy is not None else self.port}"


class RedisCluster:
    def __init__(self, binary: str, cli: str, workdir: Path, primaries: int = 3, replicas: int = 1,
                 node_timeout_ms: int = NODE_TIMEOUT_MS, proxied: bool = True,
                 extra: tuple[str, ...] = ()) -> None:
        """``proxied=False``: clients reach the nodes directly (bench/fleet.py's timings)."""
        self.binary, self.cli, self.workdir = binary, cli, workdir
        self.extra = extra
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[Node] = []
        for attempt in range(_redis.PORT_TRIES):
            try:
                self._form(primaries, replicas, proxied)
                return
            except PortTaken:
                self.close()
                self.nodes = []
                if attempt == _redis.PORT_TRIES - 1:
                    raise
            except BaseException:
                self.close()
                raise

    def _form(self, primaries: int, replicas: int, proxied: bool) -> None:
        """The nodes on ports free when picked, started and joined into one cluster (``PortTaken``
        where another process bound one of them first: the caller picks again)."""
        for _ in range(primaries * (1 + replicas)):
            port = _redis.free_port()
            self.nodes.append(Node(port, _redis.free_port(), TcpProxy(port) if proxied else None))
        for node in self.nodes:
            self.start(node, wait=False)
        for node in self.nodes:
            self._wait_listening(node)
        self._cli("--cluster", "create", *(n.addr for n in self.nodes),
                  "--cluster-replicas", str(replicas), "--cluster-yes")
        self.wait_ok()

    @property
    def url(self) -> str:
        return f"redis-cluster://{self.nodes[0].addr}"

    # -- processes -----------------------------------------------------------------------------
    def start(self, node: Node, wait: bool = True) -> None:
        assert node.proc is None
        home = self.workdir / f"node-{node.port}"  # its own: nodes.conf, and no RDB of another's
        home.mkdir(exist_ok=True)
        for stale in home.glob("*.rdb"):  # no persistence: a node starts empty
            stale.unlink()
        log = open(home / "redis.log", "ab")  # noqa: SIM115 (kept for the child)
        node.proc = subprocess.Popen(
            [self.binary, "--port", str(node.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(home), "--repl-diskless-load", "swapdb",
             "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{node.port}.conf",
             "--cluster-port", str(node.bus_port),
             *(("--cluster-announce-port", str(node.proxy.port), "--cluster-announce-bus-port",
                str(node.bus_port)) if node.proxy is not None else ()),
             "--cluster-node-timeout", str(self.node_timeout_ms),
             "--cluster-require-full-coverage", "no", "--repl-diskless-sync", "yes",
             "--repl-diskless-sync-delay", "0", *self.extra],
            stdout=log, stderr=subprocess.STDOUT, cwd=home,
        )
        log.close()
        if wait:
            self._wait_listening(node)

    def kill(self, node: Node) -> None:
        """SIGKILL: the node vanishes, its data with it."""
        if node.proc is not None:
            node.proc.kill()
            node.proc.wait()
            node.proc = None

    def close(self) -> None:
        for node in self.nodes:
            self.kill(node)
            if node.proxy is not None:
                node.proxy.close()

    def _wait_listening(self, node: Node, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # a child process starting: nothing to wait on but this
            assert node.proc is not None
            if node.proc.poll() is not None:
                why = f"redis-server exited ({node.proc.returncode}); see {self.workdir}"
                if _redis.port_taken(self.workdir / f"node-{node.port}" / "redis.log"):
                    raise PortTaken(why)
                raise RuntimeError(why)
            try:
                with socket.create_connection(("127.0.0.1", node.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.01)
        raise RuntimeError("redis-server did not start listening in time")

    def _cli(self, *args: str, timeout_s: float = 60) -> str:
        done = subprocess.run([self.cli, *args], capture_output=True, timeout=timeout_s, check=False)
        out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args[:2])} failed ({done.returncode}):\n{out}")
        return out

    # -- state -----------------------------------------------------------------------------------
    def client(self, node: Node):  # type: ignore[no-untyped-def]
        """A plain client of one node (its real port: not through the proxy)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=2)

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None]

    def topology(self) -> dict[str, dict[str, object]]:
        """Node id -> role, announced address, flags and slot ranges, as a live node sees it."""
        for node in self.live():
            try:
                text = self.client(node).execute_command("CLUSTER", "NODES")
            except Exception:
                continue
            text = text.decode() if isinstance(text, bytes) else text
            out: dict[str, dict[str, object]] = {}
            for line in text.strip().splitlines():
                parts = line.split()
                flags = parts[2].split(",")
                out[parts[0]] = {"addr": parts[1].split("@")[0], "flags": flags,
                                 "primary": "master" in flags, "slots": parts[8:],
                                 "primary_of": parts[3]}
            return out
        raise RuntimeError("no node answers CLUSTER NODES")

    def node_by_addr(self, addr: str) -> Node:
        return next(n for n in self.nodes if n.addr == addr)

    def primaries(self) -> list[tuple[str, Node]]:
        """(node id, node) of every primary that owns slots and is not failed, by a live node's view."""
        return [(nid, self.node_by_addr(str(info["addr"]))) for nid, info in self.topology().items()
                if info["primary"] and info["slots"] and "fail" not in info["flags"]]  # type: ignore[operator]

    def replica_of(self, primary_id: str) -> Node:
        return next(self.node_by_addr(str(i["addr"])) for i in self.topology().values()
                    if i["primary_of"] == primary_id)

    def node_id(self, node: Node) -> str:
        raw = self.client(node).execute_command("CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def wait_ok(self, timeout_s: float = 30.0) -> float:
        """Wait until every live node says cluster_state:ok, all 16384 slots are served by a
        primary that is up, and the live nodes agree on who owns them; the seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                views = set()
                for node in self.live():
                    r = self.client(node)
                    info = r.execute_command("CLUSTER", "INFO")
                    info = info.decode() if isinstance(info, bytes) else info
                    if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                        raise RuntimeError(info.splitlines()[0])
                    nodes = r.execute_command("CLUSTER", "NODES")
                    nodes = nodes.decode() if isinstance(nodes, bytes) else nodes
                    if self._failed_are_dead(nodes):
                        raise RuntimeError("a live node is flagged failed")
                    views.add(tuple(sorted(
                        (line.split()[1].split("@")[0], " ".join(line.split()[8:]))
                        for line in nodes.strip().splitlines() if "master" in line.split()[2]
                        and line.split()[8:])))
                if len(views) == 1:
                    return time.monotonic() - t0
                last = f"{len(views)} views"
            except Exception as e:  # a node still starting, or the cluster converging
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ok after {timeout_s} s: {last}")

    def _failed_are_dead(self, nodes_text: str) -> bool:
        """True when a node flagged fail is one that is running (so the view is stale)."""
        live = {n.addr for n in self.live()}
        for line in nodes_text.strip().splitlines():
            parts = line.split()
            if any(f in ("fail", "fail?") for f in parts[2].split(",")) and \
                    parts[1].split("@")[0] in live:
                return True
        return False

    def wait_primary(self, node: Node, timeout_s: float = 30.0) -> float:
        """Wait until ``node`` is a primary owning slots (a failover onto it); seconds taken."""
        t0 = time.monotonic()
        while time.monotonic() < t0 + timeout_s:
            try:
                role = self.client(node).execute_command("ROLE")
                if role[0] in (b"master", "master") and any(
                        n is node for _, n in self.primaries()):
                    return time.monotonic() - t0
            except Exception:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{node.addr} did not become a primary in {timeout_s} s")

    def reshard(self, source_id: str, target_id: str, slots: int) -> subprocess.Popen[bytes]:
        """``redis-cli --cluster reshard`` of ``slots`` slots, started (not waited for)."""
        log = open(self.workdir / "reshard.log", "ab")  # noqa: SIM115 (kept for the child)
        proc = subprocess.Popen(
            [self.cli, "--cluster", "reshard", self.live()[0].addr, "--cluster-from", source_id,
             "--cluster-to", target_id, "--cluster-slots", str(slots), "--cluster-yes",
             "--cluster-pipeline", "5"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return proc
