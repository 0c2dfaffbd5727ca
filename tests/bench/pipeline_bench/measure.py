"""What a run costs, read from outside the services: CPU per process group (/proc),
Valkey's memory and commands (INFO), every JetStream stream's messages and bytes, and
after a run which Redis keys are left and whether anything expires them."""

from __future__ import annotations

import resource
from dataclasses import dataclass

from services.common.bus import Bus
from tests.bench.proxy_bench import procs

# Redis key families (schemas/subjects.py), longest prefix first so each key counts once
KEY_FAMILIES = (
    "polar:task:*:sessions",
    "polar:task:*:counts",
    "polar:task:",
    "polar:session:",
    "polar:token:",
    "polar:seq:",
    "polar:tito:",
    "polar:eval:",
    "polar:lease:",
    "polar:submit:",
    "polar:node:",
    "polar:",
)


@dataclass
class Snapshot:
    cpu: dict[str, tuple[float, float]]  # process -> (own, reaped children) CPU seconds
    rss: dict[str, int]  # process group -> resident bytes
    client_cpu: float  # this benchmark's own process: submit + TrajectoryClient
    redis_memory: int
    redis_commands: int
    streams: dict[str, tuple[int, int]]  # stream -> (messages, bytes)


def client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def snapshot(pids: dict[str, int], redis, bus: Bus) -> Snapshot:
    memory = await redis.info("memory")
    stats = await redis.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))
    streams = {}
    for info in await bus.js.streams_info():
        streams[info.config.name] = (info.state.messages, info.state.bytes)
    return Snapshot(
        cpu={name: procs.cpu_split(pid) for name, pid in pids.items()},
        rss={name: procs.rss_bytes(pid) for name, pid in pids.items()},
        client_cpu=client_cpu(),
        redis_memory=int(memory["used_memory"]),
        redis_commands=calls,
        streams=streams,
    )


def family(key: str) -> str:
    for prefix in KEY_FAMILIES:
        if "*" in prefix:
            head, tail = prefix.split("*")
            if key.startswith(head) and key.endswith(tail):
                return prefix
        elif key.startswith(prefix):
            return prefix
    return "(other)"


async def key_census(redis, sample: int = 40) -> dict[str, dict]:
    """Key family -> how many keys, how many without a TTL (kept until deleted), and the
    mean MEMORY USAGE of up to ``sample`` of them."""
    found: dict[str, list[str]] = {}
    async for key in redis.scan_iter(match="polar:*", count=1000):
        k = key.decode() if isinstance(key, bytes) else key
        found.setdefault(family(k), []).append(k)
    out = {}
    for fam, keys in sorted(found.items()):
        some = keys[:sample]
        ttls = [await redis.ttl(k) for k in some]
        sizes = [await redis.memory_usage(k) or 0 for k in some]
        out[fam] = {
            "keys": len(keys),
            "no_ttl_fraction": sum(t == -1 for t in ttls) / len(some),
            "mean_bytes": sum(sizes) / len(some),
        }
    return out


async def stream_limits(bus: Bus) -> dict[str, dict]:
    """Each stream's retention as configured: policy, max age, max bytes / messages."""
    out = {}
    for info in await bus.js.streams_info():
        c = info.config
        out[c.name] = {
            "retention": str(getattr(c.retention, "value", c.retention) or "limits"),
            "max_age_days": (c.max_age or 0) / 86400,
            "max_bytes": c.max_bytes,
            "max_msgs": c.max_msgs,
            "max_msgs_per_subject": c.max_msgs_per_subject,
        }
    return out
