"""`veloxquant tune`: the lowest measured perplexity at <= R of fp16's held bytes.

1. Calibration slice: fp16, the built-ins whose bytes may fit, and a
   shortlist of each base recipe's parameter grid (space.py), measured.
2. Per-layer mixes of the best candidate that fits, measured.
3. Held-out slice: fp16, the best candidate and every built-in that fit the
   budget on the calibration slice, measured; the result says honestly
   whether the tuned recipe wins there.

Every measurement is appended to a state file as it finishes, keyed by the
recipe text and the slice, so an interrupted or repeated run skips what it
already measured (resumable). `budget_minutes` stops new calibration
measurements; the held-out confirmation always runs.
"""

import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import attrs
from tqdm import tqdm

from ..compiler.binding import needs_artifact
from ..paths import recipes_dir
from ..pool import run_all
from ..recipe import builtin_names
from . import hybrid
from .measure import Slice, measure_task
from .space import Candidate, grid, mixes, shortlist


@attrs.frozen
class Entry:
    label: str
    text: str  # the recipe YAML measured
    calib: Optional[dict] = None
    heldout: Optional[dict] = None
    builtin: bool = False


class State:
    """Measurements so far, one JSON line each: {key, result}."""

    def __init__(self, path: Path):
        self.path, self.done = path, {}
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.done[row["key"]] = row["result"]
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, key: str, result: dict) -> None:
        self.done[key] = result
        with self.path.open("a") as f:
            f.write(json.dumps({"key": key, "result": result}) + "\n")


def key_of(text: str, sl: Slice, model: str) -> str:
    # "kld": measurements made before results carried the KL divergence are measured again
    h = hashlib.sha256(json.dumps([text, attrs.asdict(sl), model, "kld"]).encode()).hexdigest()
    return h[:24]


class Search:
    def __init__(
        self,
        model_ref,
        shape,
        slices: Sequence[Slice],
        state: State,
        ray=None,
        deadline: Optional[float] = None,
        progress: bool = True,
        objective: str = "kld",
    ):
        self.model_ref, self.shape, self.state, self.ray, self.deadline = model_ref, shape, state, ray, deadline
        self.objective = objective  # what "best" minimises: OBJECTIVES
        self.calib, self.held = slices
        self.progress = progress
        self.started = time.time()
        self.context = len(self.calib.windows[0]) - 1  # tokens held at the end of a window

    def until(self, share: float) -> Optional[float]:
        """The time by which `share` of the budget is spent (None without a budget)."""
        return self.started + share * (self.deadline - self.started) if self.deadline else None

    def measure(
        self,
        items: List[Tuple[str, str]],
        sl: Slice,
        what: str,
        stop_at_deadline: bool,
        deadline: Optional[float] = None,
    ) -> Dict[str, dict]:
        """{text: result} for (label, text) items on a slice; cached ones come from the state file.
        With stop_at_deadline, no new measurement starts after `deadline` (default: the budget's end)."""
        deadline = deadline or self.deadline
        model_key = str(self.model_ref)
        done = self.state.done
        out = {t: done[key_of(t, sl, model_key)] for _, t in items if key_of(t, sl, model_key) in done}
        todo = [(label, t) for label, t in items if t not in out]
        if stop_at_deadline and deadline and time.time() > deadline:
            todo = []
        bar = tqdm(
            total=len(items),
            initial=len(items) - len(todo),
            desc=f"tune {what}",
            unit="recipe",
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        try:
            calls = [(self.model_ref, t, sl) for _, t in todo]
            if self.ray is None and stop_at_deadline:  # serial: stop between measurements when time is up
                for label, t in todo:
                    if deadline and time.time() > deadline:
                        break
                    bar.set_postfix_str(label[:40])
                    out[t] = measure_task(self.model_ref, t, sl)
                    self.state.add(key_of(t, sl, model_key), out[t])
                    bar.update(1)
            else:
                for i, result in run_all(measure_task, calls, self.ray):
                    t = todo[i][1]
                    out[t] = result
                    self.state.add(key_of(t, sl, model_key), result)
                    bar.update(1)
        finally:
            bar.close()
        return out


GRID_SHARE = 0.7


def builtin_text(name: str) -> str:
    return (recipes_dir() / f"{name}.yaml").read_text()


def run(search: Search, bases: Sequence[str], max_ratio: float, seed: int = 0) -> dict:
    """The whole search; returns {entries, best, fp16, front, builtins_in_budget}. The base
    `hybrid` is the hybrid space (hybrid.py), its points measured in an order drawn from `seed`."""
    calib, held = search.calib, search.held
    fp16 = builtin_text("fp16")
    builtins = {n: builtin_text(n) for n in builtin_names() if n != "fp16" and not needs_artifact(n)}
    fitting = {
        c.base: e
        for c, e in shortlist([Candidate(n) for n in builtins], search.shape, search.context, max_ratio, floor=0.0)
    }
    entries: Dict[str, Entry] = {}
    first = [("fp16", fp16)] + [(f"built-in {n}", builtins[n]) for n in builtins if n in fitting]
    for label, t in first:
        entries[t] = Entry(label, t, builtin=label.startswith("built-in"))
    cands = [c for base in bases if base != hybrid.NAME for c in grid(base)]
    short = shortlist(cands, search.shape, search.context, max_ratio)
    if hybrid.NAME in bases:  # each point already spends the budget exactly: no shortlist, the seeded order kept
        short += [(p, max_ratio) for p in hybrid.points(search.shape, search.context, max_ratio, seed)]
    for c, _ in short:
        entries.setdefault(c.yaml("candidate"), Entry(c.label, c.yaml("candidate")))
    # The grid gets 70% of the time budget, so per-layer mixes of its best are measured too.
    results = search.measure(
        [(e.label, e.text) for e in entries.values()], calib, "calibration", True, search.until(GRID_SHARE)
    )
    cand_of = {c.yaml("candidate"): c for c, _ in short}

    def fits(text):
        r = results.get(text)
        return r is not None and r["ratio"] <= max_ratio

    best = _best([t for t in cand_of if fits(t)], results, search.objective)
    if best is not None:  # per-layer mixes of the best parameters
        extra = _mixes(cand_of[best], search, max_ratio, seed)[:8]
        for c in extra:
            cand_of[c.yaml("candidate")] = c
            entries.setdefault(c.yaml("candidate"), Entry(c.label, c.yaml("candidate")))
        results.update(search.measure([(c.label, c.yaml("candidate")) for c in extra], calib, "mixes", True))
        best = _best([t for t in cand_of if fits(t)], results, search.objective)
    entries = {t: attrs.evolve(e, calib=results.get(t)) for t, e in entries.items()}
    confirm = [("fp16", fp16)] + [(e.label, t) for t, e in entries.items() if e.builtin and fits(t)]
    if best is not None:
        confirm.append((entries[best].label, best))
    held_results = search.measure(confirm, held, "held-out", False)
    entries = {t: attrs.evolve(e, heldout=held_results.get(t)) for t, e in entries.items()}
    return {
        "entries": entries,
        "best": best,
        "candidate": cand_of.get(best),
        "fp16": fp16,
        "front": pareto([e for e in entries.values() if e.calib], search.objective),
    }


def _mixes(best, search: Search, max_ratio: float, seed: int) -> list:
    """Per-layer variants of the best candidate that may fit, in the order they are measured."""
    if isinstance(best, hybrid.Hybrid):
        out = list(hybrid.mixes(best, search.shape, search.context, max_ratio))
        random.Random(seed).shuffle(out)
        return out
    return [c for c, _ in shortlist(list(mixes(best)), search.shape, search.context, max_ratio, floor=0.8)]


# kld: mean KL divergence from fp16's next-token distributions at every scored position; it ranks recipes
# alike on two texts where perplexity of one short window does not (docs/results.md, the ranks table).
OBJECTIVES = {"kld": lambda r: r["kld"], "ppl": lambda r: r["nll"] / r["tokens"]}


def _best(texts, results, objective: str = "kld") -> Optional[str]:
    return min(texts, key=lambda t: OBJECTIVES[objective](results[t]), default=None)


def pareto(entries: List[Entry], objective: str = "kld") -> List[Entry]:
    """Entries no other entry beats on both calibration bytes and the objective, by bytes."""
    score = OBJECTIVES[objective]
    front, best = [], float("inf")
    for e in sorted(entries, key=lambda e: (e.calib["ratio"], score(e.calib))):
        if score(e.calib) < best:
            front.append(e)
            best = score(e.calib)
    return front
