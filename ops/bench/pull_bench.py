"""Pull benchmark: our downloader against boto3's ``download_file`` on one loopback S3 server.

Runs ``moto_server`` as its own process (so the server's GIL does not throttle the client),
publishes a sharded model of ``--size`` bytes (random data in safetensors shards, like a Hugging
Face folder), measures the server's ceiling with one ``curl`` of a whole shard, then pulls the
model with boto3's default TransferConfig and with our DiskCache (default part size and boto3's
8 MiB part size), reporting MB/s, the ratio, client CPU seconds per GB and the verification tail
(time from the last byte received to the committed snapshot). Writes a JSON under docs/perf/ and
a row in docs/perf.md unless ``--no-record``.

    python ops/bench/pull_bench.py --size 2GiB --shard-size 256MiB
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from agent.units import parse_size  # noqa: E402
from cache.disk_cache import DiskCache  # noqa: E402
from cache.downloader import DownloadConfig  # noqa: E402
from cache.progress import Progress  # noqa: E402
from cache.store import open_store  # noqa: E402
from cache.publish import publish_model  # noqa: E402

MACHINE = "CPU-only dev box (2 cores)"


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_pid(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_shard(path: Path, nbytes: int) -> None:
    """A valid safetensors file holding one U8 tensor of random bytes, streamed to disk."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        left = nbytes
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n


def make_model(folder: Path, size: int, shard: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    n = max(1, (size + shard - 1) // shard)
    for i in range(n):
        write_shard(folder / f"model-{i + 1:05d}-of-{n:05d}.safetensors", min(shard, size - i * shard))


class TimedProgress(Progress):
    """Remembers when the last byte arrived, to measure what verification adds after it."""

    last_byte_at = 0.0

    def add(self, n: int) -> None:
        super().add(n)
        self.last_byte_at = time.monotonic()


def run_ours(store, name: str, cache_dir: Path, part_size: int, concurrency: int) -> dict:
    shutil.rmtree(cache_dir, ignore_errors=True)
    cfg = DownloadConfig(part_size=part_size, concurrency=concurrency, max_concurrency=max(32, concurrency))
    cache = DiskCache(cache_dir, 1 << 50, download=cfg, progress_log_interval_s=3600)
    progress = TimedProgress(name)
    c0, t0 = cpu_self(), time.monotonic()
    asyncio.run(cache.pull(store, name, progress))
    t1, c1 = time.monotonic(), cpu_self()
    got = progress.downloaded_bytes
    tail = t1 - progress.last_byte_at
    return {"seconds": t1 - t0, "bytes": got, "mb_s": got / (t1 - t0) / 1e6, "cpu_s": c1 - c0,
            "cpu_s_per_gb": (c1 - c0) / (got / 1e9), "part_size": part_size, "concurrency": concurrency,
            "verify_tail_s": tail, "verify_tail_pct": 100 * tail / (t1 - t0)}


def run_boto3(endpoint: str, bucket: str, keys: list[str], dest: Path) -> dict:
    import boto3

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    total = 0
    c0, t0 = cpu_self(), time.monotonic()
    for i, key in enumerate(keys):
        s3.download_file(bucket, key, str(dest / f"f{i}"))  # default TransferConfig
        total += (dest / f"f{i}").stat().st_size
    t1, c1 = time.monotonic(), cpu_self()
    return {"seconds": t1 - t0, "bytes": total, "mb_s": total / (t1 - t0) / 1e6, "cpu_s": c1 - c0,
            "cpu_s_per_gb": (c1 - c0) / (total / 1e9), "transfer_config": "default (8 MiB parts, 10 threads)"}


def curl_ceiling(url: str) -> dict:
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{size_download} %{time_total}", url],
                         capture_output=True, text=True, check=True).stdout.split()
    size, secs = int(out[0]), float(out[1])
    return {"bytes": size, "seconds": secs, "mb_s": size / secs / 1e6}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="512MiB", help="model size (default 512MiB: about a minute here)")
    ap.add_argument("--shard-size", default="128MiB", help="safetensors shard size (default 128MiB)")
    ap.add_argument("--part-size", default="32MiB", help="our part size (default 32MiB)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir under /work or /tmp)")
    ap.add_argument("--no-record", action="store_true", help="do not write docs/perf")
    args = ap.parse_args()
    from agent.log import configure_logging

    configure_logging("console", "warning", stream=sys.stderr)
    size, shard, part = parse_size(args.size), parse_size(args.shard_size), parse_size(args.part_size)
    commit = git_commit()  # the code that runs, even if HEAD moves during the run
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="pull-bench-",
                                                                          dir="/work" if os.access("/work", os.W_OK) else None))
    base.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    moto_bin = Path(sys.executable).with_name("moto_server")
    server = subprocess.Popen([str(moto_bin), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(base)})
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        import boto3

        bucket = "bench"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        src = base / "src"
        print(f"generating {size} bytes in {src}", file=sys.stderr)
        make_model(src, size, shard)
        store = open_store(f"s3://{bucket}/store", endpoint, "us-east-1", True, max_connections=64,
                           multipart_part_size=64 << 20)
        t0 = time.monotonic()
        manifest = publish_model(store, src, "bench-model")
        publish_s = time.monotonic() - t0
        big = max(manifest.files, key=lambda f: f.size)
        keys = [f"store/blobs/sha256/{f.sha256}" for f in manifest.files]
        ceiling = curl_ceiling(f"{endpoint}/{bucket}/store/blobs/sha256/{big.sha256}")
        print(f"curl ceiling {ceiling['mb_s']:.0f} MB/s", file=sys.stderr)
        s_cpu0 = cpu_pid(server.pid)
        boto = run_boto3(endpoint, bucket, keys, base / "boto3")
        s_cpu1 = cpu_pid(server.pid)
        shutil.rmtree(base / "boto3", ignore_errors=True)
        print(f"boto3 {boto['mb_s']:.0f} MB/s", file=sys.stderr)
        ours = run_ours(store, "bench-model", base / "cache", part, args.concurrency)
        s_cpu2 = cpu_pid(server.pid)
        print(f"ours {ours['mb_s']:.0f} MB/s", file=sys.stderr)
        ours8 = run_ours(store, "bench-model", base / "cache", 8 << 20, args.concurrency)
        print(f"ours (8 MiB parts) {ours8['mb_s']:.0f} MB/s", file=sys.stderr)
        shutil.rmtree(base / "cache", ignore_errors=True)
        store.close()
    finally:
        server.terminate()
        server.wait(10)
    boto["server_cpu_s"] = s_cpu1 - s_cpu0
    ours["server_cpu_s"] = s_cpu2 - s_cpu1
    now = dt.datetime.now(dt.timezone.utc)
    command = "python ops/bench/pull_bench.py " + " ".join(sys.argv[1:])
    result = {
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "what": "pull", "gpu": MACHINE, "machine": MACHINE,
        "commit": commit, "command": command.strip(), "cpu_cores": os.cpu_count(),
        "model": {"bytes": manifest.total_size, "files": len(manifest.files), "shard_bytes": shard},
        "server": "moto_server (own process, loopback, path-style); reads the whole object for every ranged GET",
        "publish_s": publish_s, "ceiling_curl_one_shard": ceiling,
        "ours": ours, "ours_8mib_parts": ours8, "peer": {"name": "boto3 download_file", **boto},
        "ratio": ours["mb_s"] / boto["mb_s"], "ratio_same_part_size": ours8["mb_s"] / boto["mb_s"],
    }
    print(json.dumps(result, indent=1))
    if not args.no_record:
        out = REPO / "docs" / "perf" / f"{now.strftime('%Y%m%d-%H%M')}-pull-{commit}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        figures = (f"{manifest.total_size / 2**30:.1f} GiB in {len(manifest.files)} files: ours {ours['mb_s']:.0f} MB/s "
                   f"({ours['cpu_s_per_gb']:.2f} CPU s/GB, verify tail {ours['verify_tail_pct']:.1f}%), "
                   f"boto3 download_file {boto['mb_s']:.0f} MB/s ({boto['cpu_s_per_gb']:.2f} CPU s/GB), "
                   f"ratio {result['ratio']:.2f}x (at boto3's 8 MiB parts: {result['ratio_same_part_size']:.2f}x); "
                   f"curl ceiling {ceiling['mb_s']:.0f} MB/s; server moto_server. JSON: {out.relative_to(REPO)}")
        row = f"| {now.strftime('%Y-%m-%d')} | pull | {MACHINE} | {commit} | `{command.strip()}` | {figures} |\n"
        with open(REPO / "docs" / "perf.md", "a") as f:
            f.write(row)
        print(f"wrote {out.relative_to(REPO)} and a row in docs/perf.md", file=sys.stderr)
    if not args.workdir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
