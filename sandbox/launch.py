"""Confine the engine worker: the one entry point is :func:`confine`.

The worker calls it once, after CUDA is initialised and before it serves::

    from sandbox.launch import confine
    from sandbox.limits import die_with_parent
    from sandbox.policy import default_policy
    die_with_parent(agent_pid)                     # first thing in the worker's main()
    ...                                            # init CUDA, connect the IPC socket
    report = confine(default_policy(settings.cache.dir, worker_runtime_dir, parent_pid=agent_pid))
    log.info("sandbox", **report.to_dict())

Layers are applied in an order where each one still has what it needs: the death signal and
rlimits first, the network namespace while we may still hold CAP_SYS_ADMIN, no_new_privs before
Landlock (which requires it), seccomp after our own ``unshare`` (it denies ``unshare``), and
capabilities last. Every layer is all-or-nothing: a layer the kernel refuses is skipped with a
logged warning and marked inactive in the report; nothing is left half-built. Only layers named
in ``policy.required`` turn a refusal into :class:`SandboxUnavailableError`.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable

from sandbox import bpf, landlock, limits, seccomp
from sandbox.policy import SandboxPolicy, SandboxReport, SandboxUnavailableError, default_policy

_log = logging.getLogger("infire.sandbox")


def _landlock_rules(policy: SandboxPolicy) -> list[landlock.Rule]:
    return (
        [landlock.Rule(p, landlock.READ_ONLY) for p in policy.read_only]
        + [landlock.Rule(p, landlock.READ_WRITE) for p in policy.read_write]
        + [landlock.Rule(p, landlock.DEVICE) for p in policy.devices]
    )


def _load_seccomp(policy: SandboxPolicy) -> str:
    rules = seccomp.build_rules(policy.allow_af_unix, policy.allow_unix_connect)
    backend = policy.seccomp_backend
    if backend == "libseccomp" or (backend == "auto" and seccomp.libseccomp_available()):
        return seccomp.load_libseccomp(rules)
    return bpf.load(rules)


def _apply(report: SandboxReport, name: str, step: Callable[[], str], disabled: frozenset[str] = frozenset()) -> None:
    if name in disabled:
        report.add(name, False, "disabled by policy")
        return
    try:
        detail = step()
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno == errno.EPERM:
            reason += " (not permitted here: no privilege, or blocked by the service manager)"
        _log.warning("sandbox layer %s inactive: %s", name, reason)
        report.add(name, False, reason)
    else:
        report.add(name, True, detail)


def confine(policy: SandboxPolicy) -> SandboxReport:
    """Apply every layer of ``policy`` to the calling process and report what took effect.

    Call from the thread that will run the engine loop (Landlock binds it and the threads it
    starts later; see :mod:`sandbox.landlock`). Irreversible. Raises
    :class:`SandboxPolicyError` for a malformed policy (before touching anything) and
    :class:`SandboxUnavailableError` when a layer in ``policy.required`` is inactive.
    """
    policy.validate()
    # dlopen libseccomp now: once Landlock is on, /etc/ld.so.cache may be out of reach.
    seccomp.libseccomp_available()
    report = SandboxReport()
    threads_before = limits.thread_count()

    off = policy.disabled | (frozenset() if policy.unshare_network else frozenset({"net_namespace"}))
    _apply(report, "die_with_parent", lambda: limits.die_with_parent(policy.parent_pid), off)
    _apply(report, "rlimits", lambda: limits.set_rlimits(policy.max_open_files, policy.max_processes), off)
    _apply(report, "net_namespace", limits.unshare_network, off)
    _apply(report, "no_new_privs", limits.set_no_new_privs, off)

    def do_landlock() -> str:
        if not report.is_active("no_new_privs"):
            raise OSError(errno.EOPNOTSUPP, "needs no_new_privs")
        result = landlock.restrict(
            _landlock_rules(policy),
            deny_tcp=True,
            scope_signals=policy.scope_signals,
            scope_abstract_unix=policy.scope_abstract_unix,
            other_threads=threads_before - 1,
        )
        report.skipped_paths.extend(result.skipped)
        return result.detail()

    _apply(report, "landlock", do_landlock, off)
    _apply(report, "seccomp", lambda: _load_seccomp(policy), off)
    _apply(report, "capabilities", limits.drop_capabilities, off)

    if report.inactive:
        _log.warning("sandbox partly active: active=%s inactive=%s", report.active, report.inactive)
    missing = sorted(n for n in policy.required if not report.is_active(n))
    if missing:
        details = "; ".join(f"{n}: {report.protections[n].detail}" for n in missing if n in report.protections)
        raise SandboxUnavailableError(f"required sandbox layer(s) inactive: {', '.join(missing)} ({details})")
    return report


def confine_worker(
    cache_dir: str,
    runtime_dir: str,
    parent_pid: int | None = None,
    required: list[str] | tuple[str, ...] = (),
    read_only: list[str] | tuple[str, ...] = (),
    read_write: list[str] | tuple[str, ...] = (),
) -> SandboxReport:
    """:func:`confine` with :func:`default_policy`, from JSON-friendly keyword arguments.

    This is what ``engine.worker`` calls with its ``sandbox_options`` (the agent passes its cache
    and runtime dirs, ``agent.worker.options.worker_options``). The outcome goes to stderr as one line (warnings for inactive layers come from :func:`confine`
    through ``logging``); the returned report is for the worker's status.
    """
    policy = default_policy(
        cache_dir,
        runtime_dir,
        extra_read_only=tuple(read_only),
        extra_read_write=tuple(read_write),
        parent_pid=parent_pid,
        required=frozenset(required),
    )
    # A Landlock rule needs the directory to exist now: create the cache (models pulled later
    # land there) and the writable dirs (Triton and CUDA create their caches at first use).
    for d in (cache_dir, *policy.read_write):
        if not d.startswith("/dev/"):
            try:
                os.makedirs(d, mode=0o750, exist_ok=True)
            except OSError as e:
                _log.warning("sandbox: cannot create %s: %s", d, e.strerror)
    report = confine(policy)
    # One plain line on stderr, the worker's log channel (it configures no logging handlers).
    print(f"sandbox active={report.active} inactive={report.inactive} detail={report.detail_line()}", file=sys.stderr, flush=True)
    return report
