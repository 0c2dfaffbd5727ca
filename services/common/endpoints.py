"""Where NATS and Redis are: the one place their URLs are read.

NATS: ``nats_url`` may list a cluster's servers, comma-separated
(``nats://a:4222,nats://b:4222`` or ``nats://user:pw@a:4222,b:4222``); the client
connects to any of them and reconnects across all (and to servers the cluster gossips).
A server given without a scheme or credentials takes the first one's.

Redis: ``redis://`` / ``rediss://`` for one server, or
``redis+sentinel://[user:pw@]host:port,host:port/<master-name>[/<db>]`` for a primary
with replicas under Sentinel: the master's address is asked of the sentinels at every
(re)connect, and a connection that finds itself on a demoted primary (``READONLY``)
reconnects. The credentials are the data nodes'; ``?sentinel_password=`` (and
``sentinel_username``) sign in to the sentinels when those need it.

Redis Cluster is not supported: the registry's Lua scripts (``transition.lua``,
``create_task.lua``) touch a task's keys together with global ones (the state counts,
the active-task and lease sets), which would need every key in one hash slot, i.e. one
shard: a cluster would buy nothing over a Sentinel-managed primary.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

REDIS_SCHEMES = ("redis", "rediss", "redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379


class EndpointError(ValueError):
    pass


def nats_servers(url: str) -> list[str]:
    """The server URLs in a (comma-separated) NATS URL, each with a scheme and the
    first one's credentials where it has none."""
    items = [part.strip() for part in url.split(",") if part.strip()]
    if not items:
        raise EndpointError("nats_url names no server")
    first = urlsplit(items[0] if "://" in items[0] else f"nats://{items[0]}")
    scheme = first.scheme or "nats"
    userinfo = first.netloc.rpartition("@")[0] if "@" in first.netloc else ""
    servers = []
    for item in items:
        if "://" not in item:
            item = f"{scheme}://{item}"
        u = urlsplit(item)
        if not u.hostname:
            raise EndpointError(f"nats_url: no host in server #{len(servers) + 1}")
        if "@" not in u.netloc and userinfo:
            item = f"{u.scheme}://{userinfo}@{u.netloc}{u.path}"
        servers.append(item)
    return servers


@dataclass(frozen=True)
class RedisEndpoint:
    """One Redis server, or a Sentinel-managed primary (``sentinels`` and ``master``)."""

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    @property
    def via_sentinel(self) -> bool:
        return bool(self.sentinels)


def _host_port(part: str, default_port: int) -> tuple[str, int]:
    if part.startswith("["):  # [v6]:port
        host, _, rest = part[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    host, sep, port = part.rpartition(":")
    if not sep:
        return part, default_port
    return host, int(port)


def parse_redis(url: str) -> RedisEndpoint:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in REDIS_SCHEMES:
        raise EndpointError(
            f"unsupported Redis URL scheme {scheme!r} (one of {', '.join(REDIS_SCHEMES)})"
        )
    tls = scheme.startswith("rediss")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, has_pw, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if has_pw else None
    params = {k: v[-1] for k, v in parse_qs(query).items()}
    try:
        if scheme.endswith("+sentinel"):
            sentinels = tuple(
                _host_port(h, DEFAULT_SENTINEL_PORT) for h in hosts.split(",") if h.strip()
            )
            parts = [p for p in path.split("/") if p]
            if not sentinels or not parts:
                raise EndpointError(
                    "a sentinel URL is redis+sentinel://host:port[,host:port...]/<master>[/<db>]"
                )
            return RedisEndpoint(
                db=int(parts[1]) if len(parts) > 1 else 0,
                username=username,
                password=password,
                tls=tls,
                sentinels=sentinels,
                master=unquote(parts[0]),
                sentinel_username=params.get("sentinel_username"),
                sentinel_password=params.get("sentinel_password"),
            )
        if "," in hosts:
            raise EndpointError("several Redis hosts need redis+sentinel:// (Sentinel failover)")
        host, port = _host_port(hosts, 6379) if hosts else ("127.0.0.1", 6379)
        db = path.strip("/")
        return RedisEndpoint(
            host=host or "127.0.0.1",
            port=port,
            db=int(db) if db else int(params.get("db", 0)),
            username=username,
            password=password,
            tls=tls,
        )
    except ValueError as exc:
        if isinstance(exc, EndpointError):
            raise
        raise EndpointError(f"bad Redis URL: {exc}") from None


def redis_client(url: str, **kwargs):
    """A redis-py asyncio client for ``url`` (one server, or the Sentinel master)."""
    import redis.asyncio as aioredis
    from redis.asyncio.sentinel import Sentinel

    ep = parse_redis(url)
    kwargs.setdefault("decode_responses", False)
    if not ep.via_sentinel:  # redis-py's own reading (query options, unix sockets)
        return aioredis.from_url(url, **kwargs)
    sentinel_kwargs = {
        "socket_connect_timeout": kwargs.get("socket_connect_timeout", 2),
        "socket_timeout": kwargs.get("socket_timeout", 2),
    }
    if ep.sentinel_password is not None:
        sentinel_kwargs["password"] = ep.sentinel_password
        sentinel_kwargs["username"] = ep.sentinel_username
    if ep.tls:
        kwargs["ssl"] = True
    sentinel = Sentinel(
        list(ep.sentinels),
        sentinel_kwargs=sentinel_kwargs,
        db=ep.db,
        username=ep.username,
        password=ep.password,
        **kwargs,
    )
    return sentinel.master_for(ep.master)
