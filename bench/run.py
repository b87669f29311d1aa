"""``make bench``: every benchmark against PyTorch in one run; ratios with their targets.

Writes ``bench/results.json`` and regenerates the README's performance table from it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
# Every benchmark measures first-process work: the disk cache (on by default for users) is off in
# this process and the ones it starts; bench/persist.py turns it on in its own subprocesses.
os.environ["AOTGRAD_CACHE"] = "0"
sys.path.insert(0, str(HERE))

import capture  # noqa: E402
import compiled  # noqa: E402
import distributed  # noqa: E402
import export_backends  # noqa: E402
import first_gradient  # noqa: E402
import higher_order  # noqa: E402
import library_capture  # noqa: E402
import memory  # noqa: E402
import meta_scale  # noqa: E402
import mincut  # noqa: E402
import overhead  # noqa: E402
import persist  # noqa: E402
import planning  # noqa: E402
import remat  # noqa: E402
import report_page  # noqa: E402
import scan  # noqa: E402
import transforms  # noqa: E402
from bench_models import make  # noqa: E402

README = HERE.parent / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def main() -> None:
    results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": [],
    }
    rows = results["rows"]
    # Fresh-process measures first, before this process's own work heats the machine.
    rows.extend(first_second_rows())
    for name in ("gpt4", "gpt12"):
        times = capture.measure_in_fresh_processes(name, repeats=5)
        for kind in ("cold", "warm"):
            ours, theirs, floor, eager = (times[t][kind] for t in capture.TOOLS)
            rows.append(
                row(
                    f"capture {name} ({kind})",
                    ours,
                    theirs,
                    "<= 0.50",
                    f"{ours / floor:.1f}x the fake floor; first real step {eager:.2f} s",
                )
            )
    rows.extend(library_rows(library_capture.measure_in_fresh_processes(repeats=3)))
    rows.extend(planning_rows(planning.measure_in_fresh_processes(repeats=3)))
    calls = overhead.measure()
    for phase, numbers in calls.items():
        rows.append(
            row(
                f"per call {phase} vs bare Function (us)",
                numbers["aotgrad"],
                numbers["bare"],
                "<= 1.10",
            )
        )
    rows.append(
        row(
            "per call forward vs PyTorch (us)",
            calls["forward"]["aotgrad"],
            calls["forward"]["pytorch"],
            "<= 0.50",
        )
    )
    for name in ("mlp8", "gpt4"):
        model, args = make(name)
        if name == "gpt4":
            model = untied(model)
        found = remat.compare(model, args)
        results.setdefault("remat", {})[name] = {
            label: {"saved_bytes": saved, "recompute_flops": flops}
            for label, (saved, flops) in found.items()
        }
        rows.extend(remat_rows(name, found))
        if name == "gpt4":
            plot_budgets(found, remat.frontier(model, args))
    saved = mincut.measure()
    results["mincut"] = {name: {"aotgrad": o, "pytorch": t} for name, (o, t) in saved.items()}
    rows.extend(mincut_rows(saved))
    curves = memory.run()
    results["memory"] = {name: curve.as_json() for name, curve in curves.items()}
    rows.extend(memory_rows(curves))
    memory.plot(curves, HERE / "memory.png")
    rows.extend(scan_rows(scan.measure()))
    rows.extend(scan_peak_rows(scan.peak_budgets()))
    rows.extend(transform_rows(transforms.measure()))
    speed = compiled.measure()
    rows.append(
        row(
            "training step gpt4, inductor (s)",
            speed["aotgrad_inductor"],
            speed["torch_compile"],
            "<= 1.00",
        )
    )
    fsdp = distributed.measure()
    rows.append(
        row(
            "training step FSDP2 MLP, 2 gloo ranks, inductor (s)",
            fsdp["aotgrad_inductor"],
            fsdp["torch_compile"],
            "<= 1.00",
            "rank 0; aotgrad runs every unit's hooks around one graph pair, all-gathers in flight"
            " together (Note [All-gathers in flight together])",
        )
    )
    rows.extend(wgan_gp_rows(higher_order.measure()))
    rows.extend(report_rows(report_page.measure()))
    rows.extend(persist_rows(persist.measure(pytorch=True)))
    rows.extend(export_rows(export_backends.measure()))
    results["meta_scale"] = {shape: meta_scale.measure(shape) for shape in meta_scale.SIZES}
    pytorch = {shape: meta_scale.measure(shape, pytorch=True) for shape in meta_scale.SIZES}
    rows.extend(meta_rows(results["meta_scale"], pytorch))
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    update_readme(results)


IMPORT_BUDGET = 0.15  # seconds ``import aotgrad`` may add to ``import torch`` (issue 29)


def first_second_rows() -> list[dict[str, Any]]:
    """Import, time to first gradient and ``aotgrad show``: what a new user waits for."""
    imports = first_gradient.import_seconds()
    ours, theirs = imports["aotgrad"], imports["functorch.compile"]
    rows = [
        row(
            "import aotgrad beyond import torch (s)",
            ours["seconds"],
            IMPORT_BUDGET,
            "<= 1.00",
            f"median of 5 fresh processes; reference = the {IMPORT_BUDGET} s budget; a full"
            f" garbage collection of torch's objects ran inside it in {ours['collected in']} of 5"
            f" (median {ours['collecting']:.3f} s); heaviest (-X importtime): "
            + ", ".join(f"{n} {s:.3f}" for s, n in ours["heaviest"])
            + f"; PyTorch's functorch.compile: {theirs['seconds']:.2f} s",
        )
    ]
    found = first_gradient.measure()
    per_model = []
    for name, t in found.items():
        added, added_theirs = t["aotgrad"] - t["eager"], t["pytorch"] - t["eager"]
        per_model.append(
            row(
                f"first gradient {name}, fresh process (s)",
                t["aotgrad"],
                t["pytorch"],
                "<= 0.40",
                f"added to eager's {t['eager']:.2f} s: {added:.2f} s vs {added_theirs:.2f} s"
                f" ({added / added_theirs:.2f}x)",
            )
        )
    worst = max(per_model, key=lambda r: r["ratio"])
    rows.append(
        {
            **worst,
            "what": f"first gradient, worst of {len(per_model)} models (s)",
            "note": f"{worst['what'].split(',')[0].removeprefix('first gradient ')}; "
            + worst["note"],
        }
    )
    rows.extend(per_model)
    show = first_gradient.show_seconds()
    rows.append(
        row(
            "aotgrad show examples/carry.py:fn vs python -c 'import torch' (s)",
            show["show"],
            show["import torch"],
            "<= 1.50",
            "median of 5 fresh processes",
        )
    )
    return rows


def library_rows(found: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Issue 17: capture (wrap to first forward+backward) per library model, vs PyTorch."""
    rows = [
        row(f"capture {name} (library model)", t["aotgrad"], t["pytorch"], "<= 0.40")
        for name, t in found.items()
    ]
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"library capture: worst {worst['what']} at {worst['ratio']:.2f}x", flush=True)
    return rows


def planning_rows(found: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 42: planning time of budget(peak=mid) vs PyTorch's activation_memory_budget=0.5,
    the worst repetition's (bench/planning.py)."""
    rows = []
    for name, got in found.items():
        worst = max(range(len(got["ratios"])), key=got["ratios"].__getitem__)
        ours, theirs = got["aotgrad"][worst], got["pytorch"][worst]
        rows.append(
            row(
                f"planning {name}: budget(peak=mid) vs activation_memory_budget=0.5 (s)",
                ours,
                theirs,
                "<= 1.00",
                f"worst of {len(got['ratios'])} fresh-process repetitions;"
                f" ratios {', '.join(f'{r:.2f}' for r in got['ratios'])}; mid = {got['peak']} B",
            )
        )
    return rows


def scan_rows(found: dict[str, float]) -> list[dict[str, Any]]:
    """Issue 14: scan_layers over gpt12's blocks against the unrolled blocks."""
    capture = found["capture scan_layers"]
    return [
        row(
            "capture scan_layers gpt12 vs aot_module (s)",
            capture,
            found["capture aot_module"],
            "<= 0.15",
        ),
        row(
            "capture scan_layers gpt12 vs PyTorch (s)", capture, found["capture pytorch"], "<= 0.15"
        ),
        row(
            "training step scan_layers gpt12 blocks (s)",
            found["step scan_layers"],
            found["step unrolled"],
            "<= 1.10",
            "vs aot_module of the unrolled blocks",
        ),
        row(
            "scan_layers checkpoint=True saved bytes",
            found["saved checkpoint"],
            found["saved carries + one body"],
            "<= 1.00",
            "vs the carries plus one body's saved values",
        ),
    ]


def scan_peak_rows(found: dict[str, float]) -> list[dict[str, Any]]:
    """Issue 42 item 2: peak budgets over scan_layers of gpt12's 12 blocks."""
    return [
        row(
            "scan_layers gpt12 budget(peak=) step peak, predicted vs measured (bytes)",
            found["peak predicted"],
            found["peak measured"],
            "within 2%",
            "the worst of 6: save_all's peak, the midpoint, the floor; checkpoint False/True"
            " (Note [A scan's step peak])",
        ),
        row(
            "scan_layers budget(peak=) planning, 12 gpt12 blocks vs 1 (s)",
            found["planning 12 blocks"],
            found["planning 1 block"],
            "<= 1.25",
            "the body is planned once for any depth (Note [Peak budgets over a scan])",
        ),
    ]


def transform_rows(found: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Issue 18: forward mode through a captured JVP graph; torch.func.grad (runs the function)."""
    jvp, grad = found["jvp"], found["grad"]
    return [
        row(
            "forward-mode JVP mlp8 (dual tensors), inductor vs eager (s)",
            jvp["aotgrad_inductor"],
            jvp["eager"],
            "<= 1.00",
            "a captured JVP graph",
        ),
        row(
            "torch.func.grad mlp8 through aot_module vs eager (s)",
            grad["aotgrad"],
            grad["eager"],
            "<= 1.10",
            "runs the function under the transform",
        ),
    ]


def persist_rows(found: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Issue 17: a second process's capture of gpt4 with the disk cache vs the first's.

    The target is on aotgrad's part (trace or load, compile: ``bench/persist.py``); the
    total, which also holds the model's own kernels and Dynamo's tracing, is in the note,
    with PyTorch's own second process (Inductor's caches) when it was measured.
    """
    rows = []
    for frontend in ("aot_module", "compile"):
        t = found[frontend]
        total = (
            f"wrap to first forward+backward {t['second total']:.2f} s vs"
            f" {t['first total']:.2f} s ({t['second total'] / t['first total']:.2f}x: the"
            " model's own kernels"
            + (", Dynamo's tracing" if frontend == "compile" else "")
            + " in both)"
        )
        if frontend == "compile" and "pytorch" in found:
            p = found["pytorch"]
            total += (
                f"; PyTorch's torch.compile (Inductor, its FX graph and AOTAutograd caches):"
                f" {p['second total']:.2f} s vs {p['first total']:.2f} s"
                f" ({p['second total'] / p['first total']:.2f}x)"
            )
        rows.append(
            row(
                f"capture gpt4 {frontend}, 2nd process with disk cache (aotgrad's part, s)",
                t["second aotgrad"],
                t["first aotgrad"],
                "<= 0.10",
                "vs the first process (empty cache): trace or load, compile, without the"
                f" first forward's kernels ({t['first first call']:.2f} s); {total}",
            )
        )
    return rows


def wgan_gp_rows(found: dict[str, Any]) -> list[dict[str, Any]]:
    """aotgrad+inductor vs eager, and vs torch.compile, or the reason torch.compile refused."""
    ours, eager, theirs = found["aotgrad_inductor"], found["eager"], found["torch_compile"]
    rows = [row("WGAN-GP training step vs eager, inductor (s)", ours, eager, "<= 1.15")]
    if isinstance(theirs, str):  # PyTorch refuses double backward
        rows.append(
            row(
                "WGAN-GP training step vs torch.compile (s)",
                ours,
                float("nan"),
                "<= 1.00",
                f"torch.compile refused: {theirs}",
            )
        )
    else:
        rows.append(row("WGAN-GP training step vs torch.compile (s)", ours, theirs, "<= 1.00"))
    return rows


def report_rows(found: dict[str, float]) -> list[dict[str, Any]]:
    """Issue 15: the HTML report's time-to-interactive in headless chromium, against the
    issue's 2 s budget for a 12-block GPT (reported, never asserted in tests)."""
    return [
        row(
            f"HTML report {name} time-to-interactive (s)",
            found[name],
            2.0,
            "<= 1.00",
            f"{found[name + ' nodes']:.0f} forward+backward nodes; reference = the 2 s budget",
        )
        for name in ("conv", "gpt12")
    ]


# The backends export_backends.py runs each model's step in.
BACKENDS = export_backends.BACKENDS


def export_rows(found: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 31: export time against capture time; each backend's step against eager's values."""
    rows = []
    for name, m in found.items():
        rows.append(
            row(
                f"export {name} (library model) vs its capture (s)",
                m["export"],
                m["capture"],
                "<= 0.50",
                "fresh process; forward and backward as torch.export programs",
            )
        )
    for backend in BACKENDS:
        for name, m in found.items():
            got = m[backend]
            if "refused" in got:
                rows.append(
                    claim_row(
                        f"{backend} runs {name}'s exported step", False, False, got["refused"]
                    )
                )
                continue
            note = (
                f"max |{backend} - eager| / (atol + rtol |eager|), the backend tests' tolerance;"
                f" step {got['step'] * 1e3:.1f} ms vs eager {m['eager step'] * 1e3:.1f} ms;"
                f" compile {got['compile']:.1f} s"
            )
            rows.append(
                row(
                    f"{backend} {name}: largest error vs eager",
                    got["error"],
                    1.0,
                    "<= 1.00",
                    note,
                )
            )
    return rows


def remat_rows(name: str, found: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
    """The rematerialization claims as ratio rows: min-cut bytes, budgets at the same bytes."""
    rows = [
        row(
            f"{name} mincut saved bytes",
            found["aotgrad mincut"][0],
            found["pytorch min_cut"][0],
            "<= 1.00",
        )
    ]
    for b in remat.BUDGETS:
        ours, theirs = found[f"aotgrad budget at pytorch {b}'s bytes"], found[f"pytorch budget {b}"]
        for i, what in enumerate(("saved bytes", "recompute FLOPs")):
            rows.append(
                row(f"{name} budget {b}, same bytes: {what}", ours[i], theirs[i], "<= 1.00")
            )
    return rows


def mincut_rows(found: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
    """Issue 42: saved bytes of aotgrad's "mincut" against PyTorch's min-cut, per model; the
    worst model first."""
    rows = [
        row(f"mincut saved bytes {name}", ours, theirs, "<= 1.00", "vs PyTorch's min-cut")
        for name, (ours, theirs) in found.items()
    ]
    worst = max(rows, key=lambda r: r["ratio"])
    note = f"{worst['what'].removeprefix('mincut saved bytes ')}; bytes are exact counts"
    summary = {**worst, "what": f"mincut saved bytes, worst of {len(rows)} models", "note": note}
    return [summary, *rows]


def plot_budgets(found: dict[str, tuple[int, int]], frontier: list[tuple[int, int]]) -> None:
    series = {
        "pytorch budget": "pytorch budget {b}",
        "aotgrad budget": "aotgrad budget {b}",
        "aotgrad at pytorch's bytes": "aotgrad budget at pytorch {b}'s bytes",
    }
    budgets = {
        label: [(b, *found[key.format(b=b)]) for b in remat.BUDGETS]
        for label, key in series.items()
    }
    remat.plot(frontier, budgets, str(HERE / "remat.png"))


def memory_rows(curves: dict[str, memory.Curve]) -> list[dict[str, Any]]:
    """Issue 30: measured peak at equal recompute FLOPs, and whether each peak curve is
    monotone in its budget (`bench/memory.png` plots both curves)."""
    rows = []
    for name, curve in curves.items():
        worst = curve.worst_at_equal_flops
        theirs, ours = worst.pytorch, worst.aotgrad
        assert theirs.recompute_flops is not None
        if ours is None or ours.recompute_flops is None:
            note = (
                f"worst at PyTorch's {theirs.budget:g}: no aotgrad plan recomputes at most"
                f" {theirs.recompute_flops / 1e9:.3f} GFLOP"
            )
        else:
            note = (
                f"worst at PyTorch's {theirs.budget:g}: {theirs.recompute_flops / 1e9:.3f} vs"
                f" aotgrad's {ours.recompute_flops / 1e9:.3f} recompute GFLOP"
            )
        refusals = [p.refused for p in curve.aotgrad if p.refused is not None]
        refused = len(refusals)
        if refusals:
            note += (
                f"; aotgrad had no plan at {refused} of {len(curve.aotgrad)} budgets"
                f" ({refusals[0][:120]})"
            )
        rows.append(
            row(
                f"{name} measured peak at equal recompute FLOPs (MB)",
                float("inf") if ours is None or ours.peak is None else ours.peak / 1e6,
                (theirs.peak or 0) / 1e6,
                "<= 1.00",
                note,
            )
        )
        prediction = curve.worst_prediction
        rows.append(
            row(
                f"{name} predicted peak / measured peak, worst plan",
                prediction,
                1.0,
                "within 2%",
                f"{len(curve.aotgrad) + 1} aotgrad plans (save_all and the peak budgets);"
                " predicted: Partitioned.peak.allocated, measured: measure_peak",
            )
        )
        rows.append(
            claim_row(
                f"{name} measured peak monotone in the budget",
                curve.aotgrad_monotone,
                curve.pytorch_monotone,
                f"aotgrad planned at {len(curve.aotgrad) - refused} of {len(curve.aotgrad)}"
                " budgets; reference: PyTorch's curve, for information",
            )
        )
    return rows


def claim_row(what: str, ours: bool, theirs: bool, note: str = "") -> dict[str, Any]:
    """A yes/no claim about aotgrad, with PyTorch's answer beside it; target: yes."""
    return {
        "what": what,
        "aotgrad": "yes" if ours else "no",
        "reference": "yes" if theirs else "no",
        "ratio": None,
        "target": "yes",
        "note": note,
    }


def untied(model: torch.nn.Module) -> torch.nn.Module:
    """PyTorch's aot_module rejects tied weights: compare on an untied copy."""
    model.head.weight = torch.nn.Parameter(model.tok.weight.detach().clone())  # type: ignore[union-attr]
    return model


# Issue 42, item 4: the planning of a plan may take as long as the capture it plans.
META_PLAN_TARGET = "<= 1.00"


def meta_rows(found: dict[str, Any], pytorch: dict[str, Any]) -> list[dict[str, Any]]:
    """Llama-7B/70B shapes on meta: capture vs PyTorch's, planning vs capture, RSS vs the
    parameters' bytes; the predicted peaks go to the table below the rows."""
    rows = []
    for shape, m in found.items():
        at = f"meta {shape} (b{m['batch']}, s{m['seq']})"
        rows.append(
            row(
                f"{at} capture vs PyTorch's (CPU s)",
                m["capture_cpu_s"],
                pytorch[shape]["capture_cpu_s"],
                "<= 1.00",
                f"{m['nodes']} joint nodes; each side's fresh process, its CPU seconds (wall:"
                f" {m['capture_s']:.0f} s vs {pytorch[shape]['capture_s']:.0f} s); PyTorch ="
                " aot_function, default partition, first forward+backward",
            )
        )
        for name, plan in m["plans"].items():
            if name == "save_all":
                continue
            refused = f"refused: {plan['refused']}" if "refused" in plan else ""
            what = name
            if name.startswith("budget(peak=0)"):
                what = "budget(peak=0), the floor"
            elif name.startswith("budget"):
                what = "budget(peak=mid)"
            rows.append(
                row(
                    f"{at} planning {what} vs capture (CPU s)",
                    plan["plan_cpu_s"],
                    m["capture_cpu_s"],
                    META_PLAN_TARGET,
                    refused or f"{name}: predicted peak {plan['peak_bytes'] / 1e9:.1f} GB",
                )
            )
        rows.append(
            row(
                f"{at} peak RSS above imports vs bf16 parameters (MB)",
                m["rss_mb"] - m["rss_mb_imports"],
                m["param_bytes"] / 2**20,
                "<= 0.10",
                f"peak RSS {m['rss_mb']:.0f} MB: {m['rss_mb_imports']:.0f} MB after imports,"
                f" {m['rss_mb_capture']:.0f} MB after the capture, the rest planning; PyTorch's"
                f" capture: {pytorch[shape]['rss_mb']:.0f} MB",
            )
        )
    return rows


def meta_table(found: dict[str, Any]) -> list[str]:
    """The predicted peak per GPU of one bf16 training step, per shape and plan."""
    lines = [
        "",
        "Predicted peak of one training step on one GPU (bf16, parameters and gradients"
        " included, no optimizer state), models built on `meta` (`bench/meta_scale.py`,"
        " docs/memory.md):",
        "",
        "| model | batch, seq | plan | predicted peak | saved | recompute |",
        "|---|---|---|---|---|---|",
    ]
    for shape, m in found.items():
        for name, plan in m["plans"].items():
            size = f"{m['batch']}, {m['seq']}"
            if "refused" in plan:
                lines.append(f"| {shape} | {size} | {name} | refused | | |")
                continue
            lines.append(
                f"| {shape} | {size} | {name} | {plan['peak_bytes'] / 1e9:.1f} GB"
                f" | {plan['saved_bytes'] / 1e9:.1f} GB"
                f" | {plan['recompute_flops'] / 1e12:.2f} TFLOP |"
            )
    return lines


def row(what: str, ours: float, theirs: float, target: str, note: str = "") -> dict[str, Any]:
    return {
        "what": what,
        "aotgrad": ours,
        "reference": theirs,
        "ratio": ours / theirs if theirs else (0.0 if ours == 0 else float("inf")),
        "target": target,
        "note": note,
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        f"Measured by `make bench` on {results['machine']}, {results['date']}.",
        "",
        "| benchmark | aotgrad | reference | ratio | target | |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if r["target"] == "yes":  # a claim_row
            ok = "met" if r["aotgrad"] == "yes" else "not met"
            lines.append(
                f"| {r['what']} | {r['aotgrad']} | {r['reference']} | | yes | {ok}{'; ' + r['note'] if r['note'] else ''} |"
            )
            continue
        if r["target"].startswith("within "):  # a tolerance around 1: "within 2%"
            ok = "met" if abs(r["ratio"] - 1) <= float(r["target"][7:-1]) / 100 else "not met"
        else:
            ok = "met" if r["ratio"] <= float(r["target"].split()[-1]) else "not met"
        if r["ratio"] != r["ratio"]:  # no reference: the reference tool refused (the note says)
            ok = "n/a"
        lines.append(
            f"| {r['what']} | {r['aotgrad']:.3g} | {r['reference']:.3g} | {r['ratio']:.2f}x | {r['target']} | {ok}{'; ' + r['note'] if r['note'] else ''} |"
        )
    lines += [
        "",
        "Saved bytes / recompute FLOPs per partitioner (`bench/remat.png` plots the budgets):",
        "",
    ]
    lines += ["| model | partition | saved bytes | recompute FLOPs |", "|---|---|---|---|"]
    for model, entries in results.get("remat", {}).items():
        for label, v in entries.items():
            lines.append(f"| {model} | {label} | {v['saved_bytes']:,} | {v['recompute_flops']:,} |")
    lines += meta_table(results.get("meta_scale", {})) if results.get("meta_scale") else []
    return "\n".join(lines)


def update_readme(results: dict[str, Any]) -> None:
    text = README.read_text()
    if BEGIN not in text:
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{BEGIN}\n{table(results)}\n{END}{tail}")


if __name__ == "__main__":
    main()
