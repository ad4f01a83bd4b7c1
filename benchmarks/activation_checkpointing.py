"""Activation checkpointing: memory and step time of a training step, fxparallel vs transformers, in one run.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=N benchmarks/activation_checkpointing.py [--seqs 256,512,1024]
    python benchmarks/activation_checkpointing.py --render   # plot + markdown table from the saved JSON
    torchrun --nproc_per_node=1 benchmarks/activation_checkpointing.py --device cuda   # on a GPU (NCCL)

Both systems load the same locally built 8-layer Llama (fp32, attention dropout 0, ``use_cache`` off) in the
same processes and train in train mode (``model.train()``; both apply checkpointing only in training):

- fxparallel: ``fxparallel.parallelize(path, WORLD)``, without checkpointing ("none"), with
  ``gradient_checkpointing_enable({"use_reentrant": False}, mode="selective")`` (a layer keeps its matrix
  products and recomputes the rest) and with ``mode="full"`` (a layer keeps only its inputs);
- transformers: ``from_pretrained(path, tp_plan="auto")`` (at TP=1, where a tp plan may be refused, the plain
  model; the JSON says which), without checkpointing and with
  ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`` (full).

Per sequence length (batch --batch), for each of the five (system, mode) runs:

(a) activation bytes held for backward, per rank: the bytes of tensor storage live at the end of the forward
    that were created during it (the loss's 4 bytes subtracted), counted exactly by ``LiveStorage``, a
    ``TorchDispatchMode`` that sees every op of the forward, backward and recomputation and tracks each new
    storage by a weak reference to the C++ storage, so it counts what is alive, whoever keeps it (autograd's
    saved tensors, the closures of the non-reentrant checkpoint, selective checkpointing's cache), not what a
    saved-tensor hook was shown. Sampled after a ``gc.collect()`` (reference cycles are garbage, not held;
    the JSON also has the figure before it). From the same tracker: the peak of live bytes during the forward
    and during forward + backward (sampled after every op; it includes the step's gradients, created in the
    backward after ``zero_grad(set_to_none=True)``), the bytes left at the end (the gradients), and what each
    decoder layer holds (live after the layer's forward minus before it: forward hooks on the layer modules).
    The allocator agrees: on one process (no collectives) torch's profiler with ``profile_memory=True`` gave
    the same held and peak bytes, save 5 KiB per checkpointed layer of RNG state, which is not created by an
    op. With gloo the profiler misses frees that happen on the backend's thread, hence the tracker.
(b) peak memory per rank of a whole step (forward, backward, AdamW): the RSS high-water mark
    (``benchmarks/memory.py``, reset per step), in a separate phase at the end of the run with glibc's mmap
    threshold set to 64 KiB (``mallopt``), so that every tensor of 64 KiB or more is its own mapping and is
    returned to the system when freed (without it, freed blocks are reused from the heap and the RSS shows
    the heap's high-water mark, not the live bytes). Reported as the absolute peak and as the growth over
    the RSS at the step's start (models, optimizer state and the runtime are in the start).
(c) step time (forward + backward + AdamW), median over --repeats of the slowest rank; the five runs
    alternate step by step so that other load on the machine hits them alike; the load average (1 min)
    is recorded at the start and end of every phase.

AdamW has lr=0 (and so no weight decay step either): every step of every run starts from the same
parameters, so the losses and gradients can be compared: fxparallel's selective and full runs against its
run without checkpointing (bit-identical loss and gradients, on every rank), transformers' full run against
its run without, and fxparallel's loss against transformers' (|difference| <= 1e-5).

Target (issue): full checkpointing holds at most 1/L of the activations without checkpointing plus one
layer's working set; the working set is taken as what one layer holds without checkpointing (the mean
per-layer figure of (a)), which is what the recomputation of a layer rebuilds. The JSON gives the ratio
held(full) / (held(none) / L + layer) per system and length.

Rank 0 prints a table and writes benchmarks/results/activation_checkpointing_tp{N}.json and .txt.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from checkpoints import build_checkpoint as build_default  # noqa: E402
from memory import MiB, PeakMemory  # noqa: E402
from ranks import everyone, short_error, start, synchronize, transformers_tp  # noqa: E402

warnings.filterwarnings("ignore", message="Passing `tp_plan` directly", category=FutureWarning)
# transformers 5 renames gradient_checkpointing_enable to activation_checkpointing_enable (same behaviour)
warnings.filterwarnings("ignore", message="`gradient_checkpointing_(enable|disable)` is deprecated",
                        category=FutureWarning)

# 8 layers; hidden 256, 8 heads / 4 kv heads (TP 1/2/4 split evenly); vocabulary 2048 so that the head
# (logits and their log-softmax, not checkpointed) stays small next to the layers
SHAPE = dict(hidden=256, layers=8, heads=8, kv_heads=4, intermediate=1024, vocab=2048, positions=1024)
RUNS = (("fxparallel", "none"), ("fxparallel", "selective"), ("fxparallel", "full"),
        ("transformers", "none"), ("transformers", "full"))
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="local checkpoint directory (default: the 8-layer Llama built here)")
    p.add_argument("--checkpoint-dir", default=os.path.join(ROOT, "checkpoints", "bench-llama-ac8"))
    p.add_argument("--seqs", default="256,512,1024", help="comma-separated sequence lengths")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per run and length (interleaved; median)")
    p.add_argument("--rss-repeats", type=int, default=1, help="RSS-measured steps per run and length (max)")
    p.add_argument("--runs", default=",".join(f"{s}:{m}" for s, m in RUNS), help="system:mode, comma-separated")
    p.add_argument("--out", default=None, help="rank 0 writes the JSON here (default "
                                               "benchmarks/results/activation_checkpointing_tp{N}.json)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: NCCL, one GPU per rank; (b) is "
                                                                            "then the allocator's peak")
    p.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait for a failed rank")
    p.add_argument("--render", action="store_true", help="no run: read the saved JSON (--results), write the plot "
                                                        "(--plot) and print the markdown table")
    p.add_argument("--results", default=os.path.join(HERE, "results", "activation_checkpointing_tp2.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "benchmarks_activation_checkpointing.png"))
    return p.parse_args(argv)


# ---- checkpoint ---------------------------------------------------------------
def build_checkpoint(directory: str) -> str:
    """A random 8-layer Llama (non-trivial norm weights), no KV cache in training; reused when present."""
    return build_default("llama", directory, overrides=dict(use_cache=False, attention_dropout=0.0), **SHAPE)


# ---- the two systems -----------------------------------------------------------
class System:
    name = label = ""
    note = None

    def __init__(self):
        self.model = self.optimizer = None
        self.mode = None

    def loss(self, ids):
        return self.model(input_ids=ids, labels=ids).loss

    def local_grads(self) -> dict:
        out = {}
        for name, p in self.model.named_parameters():
            g = p.grad
            if g is not None and hasattr(g, "to_local"):
                g = g.to_local()
            out[name] = None if g is None else g.detach().clone()
        return out

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


class FxParallel(System):
    name, label = "fxparallel", "fxparallel.parallelize"
    modes = ("none", "selective", "full")

    def build(self, path, world, device):
        import fxparallel

        self.model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
        self.model.train()

    def set_mode(self, mode):
        if mode != self.mode:
            if mode == "none":
                self.model.gradient_checkpointing_disable()
            else:
                self.model.gradient_checkpointing_enable({"use_reentrant": False}, mode=mode)
            self.mode = mode

    def layers(self):
        return self.model.layer_units()


class TransformersTP(System):
    name, label = "transformers", 'transformers tp_plan="auto"'
    modes = ("none", "full")

    def build(self, path, world, device):
        self.model, self.note = transformers_tp(path, world, torch.float32, device)
        if self.note:
            self.label = "transformers (plain model, TP=1)"
        self.model.train()

    def set_mode(self, mode):
        if mode != self.mode:
            if mode == "none":
                self.model.gradient_checkpointing_disable()
            elif mode == "full":
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                raise ValueError(f"transformers has no {mode!r} checkpointing")
            self.mode = mode

    def layers(self):
        return list(self.model.model.layers)


SYSTEMS = {cls.name: cls for cls in (FxParallel, TransformersTP)}


# ---- helpers --------------------------------------------------------------------
def load() -> float:
    return os.getloadavg()[0]


def set_mmap_threshold(nbytes: int) -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False


def train_step(system, ids):
    """forward + backward + AdamW (lr 0); returns the loss."""
    system.zero_grad()
    loss = system.loss(ids)
    loss.backward()
    system.optimizer.step()
    return loss.detach()


# ---- (a) exact counts of live tensor storage ------------------------------------------
class LiveStorage(TorchDispatchMode):
    """Bytes of the tensor storages created while active that are still alive.

    Every op's inputs and outputs pass through ``__torch_dispatch__`` (forward, backward and the
    recomputation alike; a tensor subclass such as DTensor is unwrapped to its local tensors). A storage
    first seen as an output is new: it is tracked by a weak reference to the C++ storage (``StorageWeakRef``)
    with its size. A storage first seen as an input existed before (parameters, the input ids, buffers), as do
    views and in-place results of it: those are never counted. ``live()`` sums the tracked storages whose
    weak reference has not expired, whichever thread freed them; it is sampled after every op (``peak``) and
    at the hooks' marks. Not counted: buffers a kernel allocates and frees inside one op, and storages
    created outside the dispatcher (e.g. the RNG state ``torch.utils.checkpoint`` saves per layer, 5 KiB)."""

    def __init__(self):
        super().__init__()
        self.tracked = {}  # storage id -> [weak ref, bytes]
        self.before = {}  # storage id -> weak ref: existed before the window
        self.peak = 0

    @staticmethod
    def _storages(tree):
        stack = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
        while stack:
            t = stack.pop()
            if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
                names, _ = t.__tensor_flatten__()
                stack.extend(x for x in (getattr(t, n, None) for n in names) if isinstance(x, torch.Tensor))
                continue
            try:
                yield t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for storage in self._storages((args, kwargs)):
            key = storage._cdata
            entry = self.tracked.get(key)
            if entry is not None and not entry[0].expired():
                continue
            self.tracked.pop(key, None)
            ref = self.before.get(key)
            if ref is None or ref.expired():
                self.before[key] = StorageWeakRef(storage)
        out = func(*args, **kwargs)
        for storage in self._storages(out):
            key = storage._cdata
            ref = self.before.get(key)
            if ref is not None and not ref.expired():
                continue  # a view or in-place result of an older storage
            self.before.pop(key, None)
            entry = self.tracked.get(key)
            if entry is not None and not entry[0].expired():
                entry[1] = max(entry[1], storage.nbytes())
            else:
                self.tracked[key] = [StorageWeakRef(storage), storage.nbytes()]
        self.live()
        return out

    def live(self) -> int:
        dead = [key for key, (ref, _) in self.tracked.items() if ref.expired()]
        for key in dead:
            del self.tracked[key]
        total = sum(size for _, size in self.tracked.values())
        self.peak = max(self.peak, total)
        return total


def counted_step(system, ids):
    """One forward + backward under ``LiveStorage``: the byte counts of point (a) of the module docstring,
    the loss and this rank's gradients."""
    system.zero_grad()
    gc.collect()
    tracker = LiveStorage()
    marks, hooks = {}, []
    in_forward = [False]

    def mark(i, where):
        def hook(module, *_):
            if in_forward[0]:
                marks.setdefault((i, where), tracker.live())
        return hook

    for i, layer in enumerate(system.layers()):
        hooks.append(layer.register_forward_pre_hook(mark(i, "pre")))
        hooks.append(layer.register_forward_hook(mark(i, "post")))
    try:
        with tracker:
            in_forward[0] = True
            loss = system.loss(ids)
            in_forward[0] = False
            forward_peak = tracker.peak
            held_now = tracker.live()
            gc.collect()  # reference cycles of the forward are garbage, not held for backward
            time.sleep(0.05)  # a collective's work object may drop its tensors on the backend's thread
            held = tracker.live()
            loss.backward()
            end = tracker.live()
    finally:
        for h in hooks:
            h.remove()
    loss_bytes = loss.untyped_storage().nbytes()
    per_layer = [marks[(i, "post")] - marks[(i, "pre")] if (i, "post") in marks and (i, "pre") in marks else None
                 for i in range(len(system.layers()))]
    return {
        "held_bytes": held - loss_bytes,
        "held_bytes_before_gc": held_now - loss_bytes,
        "forward_peak_bytes": forward_peak,
        "peak_bytes": tracker.peak,
        "end_bytes": end,  # after backward: the gradients (and anything else left)
        "layer_bytes": per_layer,
        "loss": loss.item(),
    }, system.local_grads()


def compare_grads(a: dict, b: dict):
    """(all equal, largest |difference|, names that differ)."""
    worst, differ = 0.0, []
    for name, g in a.items():
        h = b.get(name)
        if (g is None) != (h is None):
            differ.append(name)
            continue
        if g is None:
            continue
        if not torch.equal(g, h):
            differ.append(name)
            worst = max(worst, (g - h).abs().max().item())
    return not differ, worst, differ[:5]


# ---- one sequence length --------------------------------------------------------
def run_length(systems, runs, seq, args, vocab, world):
    g = torch.Generator().manual_seed(1000 + seq)
    ids = torch.randint(1, vocab, (args.batch, seq), generator=g).to(args.device)
    out = {f"{s}:{m}": {"system": s, "mode": m} for s, m in runs}
    meta = {"load_average_start": load()}
    t0 = time.perf_counter()

    # warm-up: one step per system, in its first mode (fxparallel captures a graph for a new length here)
    for s, m in runs:
        if "first_step_s" not in meta.setdefault("first_step", {}).get(s, {}):
            systems[s].set_mode(m)
            t = time.perf_counter()
            train_step(systems[s], ids)
            meta["first_step"][s] = {"mode": m, "first_step_s": max(everyone(time.perf_counter() - t))}

    meta["warmup_s"] = time.perf_counter() - t0
    # (a) exact counts and the loss / gradient checks
    t0 = time.perf_counter()
    reference_grads = {}
    for s, m in runs:
        systems[s].set_mode(m)
        counts, grads = counted_step(systems[s], ids)
        ranks = everyone(counts)
        r = out[f"{s}:{m}"]
        for key in ("held_bytes", "forward_peak_bytes", "peak_bytes", "end_bytes"):
            r[key] = max(x[key] for x in ranks)
            r[key + "_per_rank"] = [x[key] for x in ranks]
        r["layer_bytes"] = ranks[0]["layer_bytes"]
        r["held_bytes_before_gc"] = max(x["held_bytes_before_gc"] for x in ranks)
        r["loss"] = counts["loss"]
        r["loss_per_rank"] = [x["loss"] for x in ranks]
        if s not in reference_grads:
            reference_grads[s] = (m, counts["loss"], grads)
        else:
            ref_mode, ref_loss, ref_grads = reference_grads[s]
            equal, worst, differ = compare_grads(ref_grads, grads)
            checks = everyone((equal, worst, differ, counts["loss"] == ref_loss))
            r["vs"] = ref_mode
            r["grads_identical"] = all(c[0] for c in checks)
            r["grads_max_abs_diff"] = max(c[1] for c in checks)
            r["grads_differ"] = next((c[2] for c in checks if c[2]), [])
            r["loss_identical"] = all(c[3] for c in checks)
        del grads
    gc.collect()
    reference_grads.clear()

    meta["counted_s"] = time.perf_counter() - t0
    # (c) step times, the runs alternating step by step
    t0 = time.perf_counter()
    times = {key: [] for key in out}
    cpu = {key: [] for key in out}
    losses = {key: [] for key in out}
    for _ in range(args.repeats):
        for s, m in runs:
            system = systems[s]
            system.set_mode(m)
            synchronize()
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            loss = train_step(system, ids)
            synchronize()
            times[f"{s}:{m}"].append(time.perf_counter() - t)
            cpu[f"{s}:{m}"].append(time.process_time() - c)
            losses[f"{s}:{m}"].append(loss.item())
    for key, r in out.items():
        per_rank = everyone(times[key])
        per_rank_cpu = everyone(cpu[key])
        r["step_runs_s"] = [max(x) for x in zip(*per_rank)]
        r["step_s"] = statistics.median(r["step_runs_s"])
        r["step_cpu_s"] = statistics.median([max(x) for x in zip(*per_rank_cpu)])
        r["timed_losses_equal"] = len(set(losses[key])) == 1 and losses[key][0] == r["loss"]
    meta["timed_s"] = time.perf_counter() - t0
    meta["load_average_end"] = load()
    meta["tokens"] = args.batch * seq

    summary = {}
    for s in systems:
        none = out.get(f"{s}:none")
        full = out.get(f"{s}:full")
        if none and full:
            layers = [b for b in none["layer_bytes"] if b is not None]
            layer = sum(layers) / len(layers) if layers else 0  # mean: a layer's figure moves by a tensor or
            # two when a collective's input is freed on the backend's thread after the layer's end
            target = none["held_bytes"] / len(none["layer_bytes"]) + layer
            summary[s] = {"layer_bytes_none": layer, "target_bytes": target,
                          "ratio_full_to_target": full["held_bytes"] / target,
                          "full_over_none": full["held_bytes"] / none["held_bytes"]}
            sel = out.get(f"{s}:selective")
            if sel:
                summary[s]["selective_over_none"] = sel["held_bytes"] / none["held_bytes"]
    if "fxparallel:none" in out and "transformers:none" in out:
        summary["loss_fx_minus_hf"] = out["fxparallel:none"]["loss"] - out["transformers:none"]["loss"]
        summary["loss_fx_matches_hf"] = abs(summary["loss_fx_minus_hf"]) <= 1e-5
    return {"runs": out, "summary": summary, "meta": meta}


def rss_phase(systems, runs, seqs, args, vocab):
    """(b): the RSS high-water mark of whole steps, mmap threshold 64 KiB (see the module docstring); on a GPU,
    the CUDA allocator's peak of allocated bytes."""
    ok = set_mmap_threshold(64 * 1024) if args.device == "cpu" else None
    meter = PeakMemory(torch.device(args.device))
    t0 = time.perf_counter()
    result = {"mmap_threshold_set": ok, "kind": None, "load_average_start": load()}
    for seq in seqs:
        g = torch.Generator().manual_seed(1000 + seq)
        ids = torch.randint(1, vocab, (args.batch, seq), generator=g).to(args.device)
        per = {}
        for _ in range(args.rss_repeats):
            for s, m in runs:
                systems[s].set_mode(m)
                systems[s].zero_grad()
                dist.barrier()
                meter.start()
                train_step(systems[s], ids)
                peak, growth = meter.stop()
                per.setdefault(f"{s}:{m}", []).append((peak, growth))
        result[str(seq)] = {}
        for key, values in per.items():
            ranks = everyone(values)
            result[str(seq)][key] = {"peak_mib": max(max(v[0] for v in r) for r in ranks),
                                     "growth_mib": max(max(v[1] for v in r) for r in ranks),
                                     "peak_mib_per_rank": [max(v[0] for v in r) for r in ranks],
                                     "growth_mib_per_rank": [max(v[1] for v in r) for r in ranks]}
    result["kind"] = meter.kind
    result["load_average_end"] = load()
    result["wall_s"] = time.perf_counter() - t0
    return result


# ---- tables --------------------------------------------------------------------------
def _mib(b):
    return f"{b / MiB:.2f}"


def format_table(meta, results, rss):
    lines = [f"llama {meta['shape']}, tp={meta['tp']}, batch {meta['batch']}, fp32, AdamW lr=0, {meta.get('device', 'cpu')}/{meta['backend']}, "
             f"{meta['threads']} thread(s)/rank, {meta['cores']} cores; step time = median of {meta['repeats']} "
             f"interleaved steps (slowest rank); bytes per rank (max over ranks); load average "
             f"{meta['load_average_start']:.2f} at the start, {meta['load_average_end']:.2f} at the end"]
    for name, label in meta["labels"].items():
        lines.append(f"  {name}: {label}")
    header = ["seq", "system", "mode", "held MiB", "vs none", "fwd peak MiB", "fwd+bwd peak MiB", "grads MiB",
              "layer MiB", "peak MiB (b)", "growth MiB (b)", "step ms", "vs none", "step CPU ms",
              "vs none", "loss", "check"]
    rows = []
    for seq, res in results.items():
        runs = res["runs"]
        for key, r in runs.items():
            none = runs.get(f"{r['system']}:none", r)
            layer = [b for b in r["layer_bytes"] if b is not None]
            x = rss.get(str(seq), {}).get(key) if rss else None
            check = ""
            if "grads_identical" in r:
                check = "identical" if r["grads_identical"] and r["loss_identical"] else \
                    f"DIFFER (max {r['grads_max_abs_diff']:.1e})"
            rows.append([str(seq), r["system"], r["mode"], _mib(r["held_bytes"]),
                         f"{r['held_bytes'] / none['held_bytes']:.3f}", _mib(r["forward_peak_bytes"]),
                         _mib(r["peak_bytes"]), _mib(r["end_bytes"]),
                         _mib(sum(layer) / len(layer)) if layer else "-",
                         f"{x['peak_mib']:.0f}" if x else "-", f"{x['growth_mib']:.1f}" if x else "-",
                         f"{r['step_s'] * 1e3:.0f}", f"{r['step_s'] / none['step_s']:.2f}x",
                         f"{r['step_cpu_s'] * 1e3:.0f}", f"{r['step_cpu_s'] / none['step_cpu_s']:.2f}x",
                         f"{r['loss']:.6f}", check])
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    for seq, res in results.items():
        s = res["summary"]
        for name in ("fxparallel", "transformers"):
            if name in s:
                t = s[name]
                lines.append(f"seq {seq} {name}: full holds {t['full_over_none']:.3f} of none; target = none/L + one "
                             f"layer ({_mib(t['layer_bytes_none'])} MiB) = {_mib(t['target_bytes'])} MiB; "
                             f"full / target = {t['ratio_full_to_target']:.3f}"
                             + (f"; selective holds {t['selective_over_none']:.3f} of none"
                                if "selective_over_none" in t else ""))
        if "loss_fx_minus_hf" in s:
            lines.append(f"seq {seq}: loss fxparallel - transformers = {s['loss_fx_minus_hf']:.2e} "
                         f"({'<= 1e-5' if s['loss_fx_matches_hf'] else 'MORE THAN 1e-5'}); load "
                         f"{res['meta']['load_average_start']:.2f} -> {res['meta']['load_average_end']:.2f}")
    if rss:
        lines.append(f"RSS phase: {rss['kind']}, mmap threshold 64 KiB set: {rss['mmap_threshold_set']}, load "
                     f"{rss['load_average_start']:.2f} -> {rss['load_average_end']:.2f}")
    return "\n".join(lines)


# ---- rendering ---------------------------------------------------------------------
STYLE = {"fxparallel:none": ("fxparallel, no checkpointing", "tab:blue", "-", "o"),
         "fxparallel:selective": ("fxparallel, selective", "tab:blue", "--", "^"),
         "fxparallel:full": ("fxparallel, full", "tab:blue", ":", "s"),
         "transformers:none": ('transformers tp_plan="auto", no checkpointing', "tab:orange", "-", "o"),
         "transformers:full": ('transformers tp_plan="auto", full', "tab:orange", ":", "s")}


def markdown_table(run):
    m = run["meta"]
    rss = run.get("rss") or {}
    peak = "RSS peak" if m.get("device", "cpu") == "cpu" else "CUDA peak allocated"
    lines = ["| seq | system | checkpointing | held for backward MiB/rank | vs none | one layer holds MiB | "
             f"peak live fwd+bwd MiB/rank (grads) | {peak} MiB/rank (growth in the step) | step ms | "
             "step CPU ms | CPU vs none | loss, grads vs none |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for seq in sorted(run["results"], key=int):
        res = run["results"][seq]
        for key, r in res["runs"].items():
            none = res["runs"].get(f"{r['system']}:none", r)
            layer = [b for b in r["layer_bytes"] if b is not None]
            x = rss.get(seq, {}).get(key)
            check = "-" if "grads_identical" not in r else \
                ("identical" if r["grads_identical"] and r["loss_identical"] else "**differ**")
            lines.append(f"| {seq} | {r['system']} | {r['mode']} | **{_mib(r['held_bytes'])}** | "
                         f"{r['held_bytes'] / none['held_bytes']:.3f} | "
                         f"{_mib(sum(layer) / len(layer)) if layer else '-'} | "
                         f"{_mib(r['peak_bytes'])} ({_mib(r['end_bytes'])}) | "
                         + (f"{x['peak_mib']:.0f} ({x['growth_mib']:.0f}) | " if x else "- | ")
                         + f"{r['step_s'] * 1e3:.0f} | {r['step_cpu_s'] * 1e3:.0f} | "
                           f"{r['step_cpu_s'] / none['step_cpu_s']:.2f}x | {check} |")
    lines += ["", "| seq | system | target: none / L + one layer MiB | full MiB | **full / target** | "
                  "selective / none | full / none | loss fx - hf | load avg start / end |",
              "|---|---|---|---|---|---|---|---|---|"]
    for seq in sorted(run["results"], key=int):
        res = run["results"][seq]
        s = res["summary"]
        for name in ("fxparallel", "transformers"):
            if name in s:
                t = s[name]
                full = res["runs"][f"{name}:full"]["held_bytes"]
                lines.append(f"| {seq} | {name} | {_mib(t['target_bytes'])} | {_mib(full)} | "
                             f"**{t['ratio_full_to_target']:.2f}** | "
                             + (f"{t['selective_over_none']:.2f} | " if "selective_over_none" in t else "- | ")
                             + f"{t['full_over_none']:.2f} | "
                             + (f"{s['loss_fx_minus_hf']:.1e} | " if "loss_fx_minus_hf" in s else "- | ")
                             + f"{res['meta']['load_average_start']:.1f} / {res['meta']['load_average_end']:.1f} |")
    return "\n".join(lines) + f"\n\n(TP={m['tp']}, batch {m['batch']}, fp32; whole run {m['wall_s'] / 60:.1f} min, " \
                              f"load average {m['load_average_start']:.1f} at the start, " \
                              f"{m['load_average_end']:.1f} at the end)"


def plot(run, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = run["meta"]
    gpu = m.get("device", "cpu") != "cpu"  # there the step's wall time (the CPU time is the GPU's, waited for)
    seqs = sorted(int(s) for s in run["results"])
    panels = [("held_bytes", "activation bytes held for backward\n(MiB per rank, exact)"),
              ("peak_bytes", "peak live bytes, forward + backward\n(MiB per rank, incl. gradients)"),
              ("step_s", "time of a step, fwd+bwd+AdamW\n(ms per rank, median)") if gpu else
              ("step_cpu_s", "CPU time of a step, fwd+bwd+AdamW\n(ms per rank, median)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, panels):
        for name, (label, color, style, marker) in STYLE.items():
            points = [(s, run["results"][str(s)]["runs"][name][key]) for s in seqs
                      if name in run["results"][str(s)]["runs"]]
            if not points:
                continue
            xs, ys = zip(*points)
            ys = [y * 1e3 for y in ys] if key.endswith("_s") else [y / MiB for y in ys]
            ax.plot(xs, ys, color=color, linestyle=style, marker=marker, label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_xticks(seqs)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"activation checkpointing, 8-layer Llama (hidden {m['shape']['hidden']}), TP={m['tp']}, batch "
                 f"{m['batch']}, fp32, " + (f"{m['device']}, {m['date']}" if gpu else "CPU/gloo"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(args):
    if not os.path.exists(args.results):
        print(f"no {args.results}", file=sys.stderr)
        return 1
    with open(args.results) as f:
        run = json.load(f)
    plot(run, args.plot)
    print(markdown_table(run))
    print(f"\nwrote {args.plot}")
    return 0


# ---- main -------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    if args.render:
        return render(args)
    t_start = time.perf_counter()
    load_start = load()
    rank, world, path = start(args.model, args.checkpoint_dir, build_checkpoint, args.timeout, args.device)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    out_path = args.out or os.path.join(HERE, "results", f"activation_checkpointing_tp{world}.json")
    runs = [tuple(r.split(":")) for r in args.runs.split(",") if r]
    seqs = [int(s) for s in args.seqs.split(",") if s]

    systems, errors, labels, notes = {}, {}, {}, {}
    for name in dict.fromkeys(s for s, _ in runs):
        s = SYSTEMS[name]()
        try:
            s.build(path, world, args.device)  # (fxparallel: on the GPU under NCCL)
            s.optimizer = torch.optim.AdamW(s.model.parameters(), lr=0.0)
            err = None
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            err = short_error(e)
        failed = [(i, e) for i, e in enumerate(everyone(err)) if e]
        if failed:
            errors[name] = f"rank {failed[0][0]}: {failed[0][1]}"
            continue
        systems[name], labels[name], notes[name] = s, s.label, s.note
    runs = [(s, m) for s, m in runs if s in systems]

    results = {}
    for seq in seqs:
        try:
            results[seq] = run_length(systems, runs, seq, args, config.vocab_size, world)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            errors[f"seq {seq}"] = short_error(e)
            break
        if rank == 0:
            print(f"seq {seq} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    rss = None
    if args.rss_repeats > 0 and not errors:
        try:
            rss = rss_phase(systems, runs, list(results), args, config.vocab_size)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            errors["rss"] = short_error(e)

    import transformers

    meta = {"model": path, "tp": world, "shape": dict(SHAPE) if args.model is None else None, "batch": args.batch,
            "seqs": seqs, "repeats": args.repeats, "rss_repeats": args.rss_repeats, "dtype": "float32",
            "backend": dist.get_backend(), "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cores": os.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_average_start": load_start,
            "load_average_end": load(), "wall_s": time.perf_counter() - t_start, "labels": labels, "notes": notes,
            "errors": errors}
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump({"meta": meta, "results": {str(k): v for k, v in results.items()}, "rss": rss}, f, indent=1)
        if results:
            print("\n" + format_table(meta, results, rss))
        for name, err in errors.items():
            print(f"error ({name}): {err}")
        with open(os.path.splitext(out_path)[0] + ".txt", "w") as f:
            f.write(format_table(meta, results, rss) + "\n" if results else "")
            for name, err in errors.items():
                f.write(f"error ({name}): {err}\n")
        print(f"wrote {out_path}")
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
