"""The launcher's roles in a multi-host run (executor/run.py): a thread in worker 0's process.

First it agrees on the run's id with every worker (run.open_run): every later record is bound to
it, so a record of an earlier run replayed into the store is named and skipped. It holds the
build's run lock, decides where the run starts (a resume, also automatically after
a torchrun restart), checks the data, and publishes that as the `plan` record every worker waits
for. Then it reads every worker's events (`ev/<w>/<n>`, in order) into the single-host launcher's
`_Progress` (progress lines, --json-log, COMPLETE once every worker's checkpoint files are
durable) and every worker's heartbeat record (`hb/<w>`, which counts the events sent, so one
that never arrives is noticed). What stops a run, and how it is named:

- a worker's own error (not a broken link; the earliest, if several): its located message, who
  said it and where, and the broken links that followed in its peers;
- a worker whose heartbeat stopped changing for HANG_AFTER_S: hung, or its process died;
- every worker of one host silent: that host is lost (killed, or its link cut);
- otherwise the first broken link reported.

A broken link is usually the other end's failure, so after one the coordinator waits until a
silent peer would be declared silent before it blames anyone. The verdict goes to the console
and into the `stop` record, which every worker's heartbeat obeys.
"""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import numpy as np

from executor import launcher
from executor.checkpoint import build_fingerprint, complete_steps, resume_point, run_identity
from executor.rundir import RunLock
from executor.run import HANG_AFTER_S, HEARTBEAT_S, STARTUP_S, open_run
from h2ir.errors import H2Error, InternalError, internal_error_text

POLL_S = 0.02           # step lines are timed by when the events arrive


class Coordinator(threading.Thread):
    def __init__(self, build, a, env, records, stop, console):
        super().__init__(daemon=True, name="h2x-coordinator")
        self.build, self.a, self.env, self.records, self.stop, self.console = \
            build, a, env, records, stop, console
        self.W = len(build.workers)
        self.result = launcher.RunResult()

    def out(self, text: str) -> None:
        print(text, flush=True)

    def run(self):
        try:
            self._run()
        except H2Error as e:
            self._fail(str(e))
        except InternalError as e:
            self._fail(f"{e.prog}: internal error: {e.message}\n  this is a bug in h2; "
                       + (f"the traceback is in {e.report}" if e.report else "see its log")
                       + (f"\n  {e.context}" if e.context else ""))
        except BaseException as e:          # noqa: BLE001 - a bug here stops the run, named
            from h2ir.errors import crash_report
            self._fail(internal_error_text("h2x run coordinator", e,
                                           crash_report("h2x run coordinator", e)))

    def _fail(self, message: str) -> None:
        with contextlib.suppress(Exception):
            self.records.put("stop", {"message": message})
        self.stop(message)

    # ---- start ------------------------------------------------------------------------------------
    def _start_point(self, ckpt_dir: Path, fingerprint: str) -> tuple[int, Path | None]:
        a, out = self.a, self.out
        mode = a.resume or ("auto" if self.env.restart_count > 0 else None)
        if mode == "auto" and not complete_steps(ckpt_dir):
            if self.env.restart_count > 0:
                out(f"restart {self.env.restart_count}: no complete checkpoint in {ckpt_dir}; "
                    "starting from step 0")
            return 0, None
        if not mode:
            return 0, None
        if self.env.restart_count > 0:
            out(f"restart {self.env.restart_count} (torchrun): resuming automatically")
        return launcher._resume_point(ckpt_dir, True, fingerprint, self.W, out)

    def _run(self):
        a, build, out = self.a, self.build, self.out
        run_id = open_run(self.records, self.W, STARTUP_S)
        ckpt_dir = Path(a.checkpoint_dir) if a.checkpoint_dir else build.path / "ckpt"
        uses = a.checkpoint_every or a.resume or self.env.restart_count > 0
        with RunLock(build.path, ckpt_dir if uses else None, writes=bool(a.checkpoint_every),
                     out=out):
            launcher._check_outputs(build, a.checkpoint_every, a.json_log, a.trace, ckpt_dir)
            transport = launcher._pick_transport(a.transport, a.strict_transport, out)
            fingerprint = build_fingerprint(build.path)
            start, resume_from = self._start_point(ckpt_dir, fingerprint)
            settings = launcher.run_data(build, a.job, out)
            settings["run"] = run_identity(fingerprint, resume_from)   # binds its checkpoints
            sim = launcher._predict(build, out)
            hosts = build.hosts
            out(f"starting {self.W} worker(s) on {len(hosts)} host(s) ["
                + "; ".join(f"host {h}: " + ", ".join(
                    f"w{w} stage {build.workers[w]['stage']}" for w in ws)
                    for h, ws in enumerate(hosts))
                + f"] over {transport} (tcp between hosts); run {self.env.run_id} "
                f"(id {run_id.hex()})"
                + (f", restart {self.env.restart_count}" if self.env.restart_count else ""))
            if start >= a.steps:
                out(f"nothing to do: checkpoint is at step {start}, --steps is {a.steps}")
            self.records.put("plan", {
                "start": min(start, a.steps), "resume_from": str(resume_from) if resume_from else None,
                "transport": transport, "checkpoint_dir": str(ckpt_dir),
                "settings": settings,
                "trace": bool(a.trace), "t0_wall": time.time()})
            with (launcher.open_json_log(a.json_log, append=bool(start)) if a.json_log
                  else contextlib.nullcontext()) as log_f:
                run = launcher._Run(build, [], [], None, None, np.zeros((self.W, 4)), ckpt_dir,
                                    time.perf_counter(), fingerprint)
                progress = launcher._Progress(run, self.result, a.steps, start, log_f, out,
                                              launcher.tensorboard_writer(
                                                  a.job.logging.tensorboard),
                                              a.job.checkpoint.keep_last)
                self._pump(run, progress)
            out(self._links_by_host(progress.links))
            if a.trace:         # every worker published its trace before its `done`
                from executor.run import collect_trace
                launcher.write_trace(build, {w: collect_trace(self.records, w, 30.0)
                                             for w in range(self.W)}, a.trace)
                out(f"trace: {a.trace} ({self.W} workers, every host)")
            self.records.put("finished", {"ok": True})
        if sim is not None and len(self.result.step_s) > 1:
            measured = float(np.median(self.result.step_s[1:]))
            out(f"step time: predicted {sim.step_time_s:.3f} s, measured {measured:.3f} s "
                f"(median of steps 2..{len(self.result.step_s)}), error "
                f"{(sim.step_time_s - measured) / measured:+.1%}")
        for line in launcher.memory_summary(self.build, self.result.peak_memory):
            out(line)

    # ---- the run ----------------------------------------------------------------------------------
    def _pump(self, run, progress):
        W, rec = self.W, self.records
        next_ev = [0] * W
        hb_n = [None] * W
        hb: list[dict] = [{} for _ in range(W)]
        changed = [time.monotonic()] * W
        t_start = time.monotonic()
        next_hb = 0.0
        trouble_since = silent_since = None
        missing_since: list = [None] * W       # when a heartbeat first counted an unread event
        while len(progress.done) < W:
            for w in range(W):
                while (ev := rec.poll(f"ev/{w}/{next_ev[w]}", f"worker w{w}'s event")) is not None:
                    next_ev[w] += 1
                    progress.on_event(w, ev)
            now = time.monotonic()
            if now >= next_hb:
                next_hb = now + HEARTBEAT_S
                for w in range(W):
                    r = rec.poll(f"hb/{w}", f"worker w{w}'s heartbeat")
                    n = r.get("n") if r is not None else None
                    if type(n) is int and (hb_n[w] is None or n > hb_n[w]):
                        hb_n[w], hb[w], changed[w] = n, r, now
                        run.status[w, 1:4] = (r.get("step", 0), r.get("pc", 0), r.get("state", 0))
                    sent = hb[w].get("events", 0)
                    if type(sent) is not int or sent <= next_ev[w]:
                        missing_since[w] = None
                    elif missing_since[w] is None:
                        missing_since[w] = now
                    elif now - missing_since[w] > HANG_AFTER_S:
                        raise H2Error(
                            f"worker w{w}'s event {next_ev[w]} (record '{rec.ns}/ev/{w}/"
                            f"{next_ev[w]}') was sent but never arrived: another process "
                            f"overwrote it in the run's store. All workers stopped.",
                            hint="something that can reach the store is interfering with the "
                                 "run; keep its port private (--iface, firewall)")
            silent = [w for w in range(W) if w not in progress.done
                      and (now - changed[w] > HANG_AFTER_S if hb_n[w] is not None
                           else now - t_start > STARTUP_S)]
            errors = progress.errors
            if (silent or errors) and trouble_since is None:
                trouble_since = now
            if silent and silent_since is None:
                silent_since = now
            if trouble_since is not None:
                own = [w for w in errors if errors[w].get("kind") != "comm"]
                # after a broken link, wait until a dead or cut-off peer would show as silent;
                # after the first silent worker, until the rest of its host would too
                # (heartbeats are written and read every HEARTBEAT_S: up to 2 periods apart)
                if (own and now - trouble_since > 0.3) or \
                        (silent and now - silent_since > 4 * HEARTBEAT_S) or \
                        (not silent and now - trouble_since > HANG_AFTER_S + 1.5):
                    self._verdict(run, progress, own, silent, hb, changed, now)
            time.sleep(POLL_S)

    def _verdict(self, run, progress, own, silent, hb, changed, now):
        build, errors = self.build, progress.errors
        if own:                 # the earliest own failure (by its event's time), then the rest
            w = launcher._root_cause([], [], {w: errors[w] for w in own}, {}, [])
            try:
                launcher._raise_worker_error(build, w, errors, progress.connected, run.status)
            except H2Error as e:
                e.hint = (e.hint or "") + self._on_host(w, hb) + launcher._consequences(errors, w)
                raise
        if silent:
            by_host: dict[int, list[int]] = {}
            for w, h in enumerate(build.workers):
                by_host.setdefault(hb[w].get("host", h.get("host", 0)), []).append(w)
            for h, ws in sorted(by_host.items()):
                if all(w in silent for w in ws):
                    age = min(now - changed[w] for w in ws)
                    name = next((hb[w]["hostname"] for w in ws if hb[w].get("hostname")), "?")
                    addr = next((hb[w]["addr"] for w in ws if hb[w].get("addr")), "?")
                    last = "; ".join(f"w{w} at '{launcher._instruction(build, w, run.status)}' "
                                     f"of step {int(run.status[w, 1]) + 1}" for w in ws)
                    raise H2Error(
                        f"host {h} ({name}, {addr}) lost: no heartbeat from any of its workers "
                        f"({' '.join(f'w{w}' for w in ws)}) for {age:.1f} s — its processes "
                        f"died or its network is cut; last: {last}. All workers stopped.",
                        hint="with torchrun's --max-restarts the job restarts once the host is "
                             "back and resumes from the newest complete checkpoint")
            w = silent[0]
            info = build.workers[w]
            raise H2Error(
                f"worker w{w} (stage {info['stage']}, replica {info['replica']}, "
                f"{info['backend']}){self._on_host(w, hb, ' on')} stopped responding (no "
                f"heartbeat for {now - changed[w]:.1f} s: hung, or its process died); last "
                f"instruction: '{launcher._instruction(build, w, run.status)}' of step "
                f"{int(run.status[w, 1]) + 1}. All workers stopped.")
        w = next(iter(errors))
        launcher._raise_worker_error(build, w, errors, progress.connected, run.status)

    def _links_by_host(self, links: list[dict]) -> str:
        """"links within hosts: 4 shm; between hosts: 6 tcp": what each kind of link used."""
        host = [w.get("host", 0) for w in self.build.workers]
        parts = []
        for what, same in (("within hosts", True), ("between hosts", False)):
            counts: dict[str, int] = {}
            for link in links:
                if (host[link["src"]] == host[link["dst"]]) == same:
                    counts[link["transport"]] = counts.get(link["transport"], 0) + 1
            parts.append(f"{what}: " + (", ".join(f"{n} {t}" for t, n in counts.items())
                                        or "none"))
        return "links " + "; ".join(parts)

    @staticmethod
    def _on_host(w, hb, prefix="; on") -> str:
        r = hb[w]
        return f"{prefix} host {r['host']} ({r.get('hostname', '?')})" if "host" in r else ""
