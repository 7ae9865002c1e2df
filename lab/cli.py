"""The `lab` command (each command's flags: lab COMMAND --help).

  lab info                          this CPU, its kernel paths, and the native build
  lab tune                          measure the kernels' speed-only choices on this CPU (cached)
  lab models list|fetch NAME...     the models the lab knows; get them into the cache
  lab models export NAME...         write the engine's file of each (--scheme; --draft-vocab N --for TARGET)
  lab models compare|ppl NAME...    the reference against transformers; perplexity per format
  lab run [NOTEBOOK...]             notebooks -> HTML reports under a profile (papermill)
  lab results [--readme README.md]  a profile's headline figures as Markdown (into README's block)
  lab worker ADDRESS                serve a Dask scheduler as one machine (lab run --scheduler)
  lab generate PROMPT               generate text, plain or speculative (--draft MODEL, --lookup)
  lab bench bandwidth               read (and copy/triad) bandwidth against thread count
  lab bench kernels                 each kernel and k against the read ceiling and issue peak
  lab bench decode                  one-token decode steps against the read ceiling (--stages)
  lab bench vk                      v(k), c and o: the costs speculation is predicted from
  lab bench speculative             speculative against plain decoding on Spec-Bench prompts
  lab bench baseline                the lab beside llama.cpp and transformers, paired in one run

Every bench takes --json. Bad input is refused before any work in one line on stderr
(`lab: error: ...`, exit status 2; LAB_DEBUG=1 shows the traceback).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from . import native, profiles
from .errors import LabError
from .profiles import COUNT, Range
from .results import add_results_parser


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in the lab's one-line form (the usage is one --help away)."""

    def error(self, message):
        self.exit(2, f"lab: error: {message} (see {self.prog} --help)\n")


def _number(kind, rule):
    """An argparse type: an int (kind int) or a float within rule, a Range or a function that
    makes one only when the flag is given (some bounds come from the engine)."""
    noun = "an integer" if kind is int else "a number"

    def parse(s: str):
        r = rule() if callable(rule) else rule
        try:
            x = kind(s)
        except ValueError:
            x = None
        if x is None or not r.admits(x):
            raise argparse.ArgumentTypeError(f"must be {noun} {r.text()}, got {s!r}")
        return x
    return parse


def _list(item):
    """An argparse type: comma-separated values, each parsed by item."""
    def parse(s: str) -> list:
        xs = [item(x) for x in s.split(",") if x.strip()]
        if not xs:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {s!r}")
        return xs
    return parse


_COUNT = _number(int, COUNT)
_THREADS = _number(int, profiles.cpu_threads)
_GAMMA = _number(int, profiles.guesses)
_DRAFT_VOCAB = _number(int, Range(0, why="0: the stock draft"))
_TEMPERATURE = _number(float, Range(0))
_SEED = _number(int, Range(0, 2 ** 64 - 1))
DEFAULT_MAX_CONTEXT = 4096     # generate's KV cache unless told (the model's longest context if shorter)


def _scheduler(s: str) -> str:
    """An argparse type: local, local:N (N worker processes here) or a scheduler's address."""
    if s.startswith("local:"):
        try:
            _COUNT(s.split(":", 1)[1])
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"local:N takes N worker processes: N {e}") from None
    elif not s.strip():
        raise argparse.ArgumentTypeError("give a scheduler address (tcp://HOST:8786) or local[:N]")
    return s


# ----------------------------------------------------------------------------
# Checks that need more than one flag, a model's config or the engine: all before any work
# ----------------------------------------------------------------------------

def _check_schemes(*flags: tuple[str, str]) -> None:
    """(flag, scheme) pairs: a bad scheme would otherwise surface only after the model loads."""
    from .models.twin import SCHEMES
    for flag, scheme in flags:
        if scheme not in SCHEMES:
            raise LabError(f"{flag} {scheme}: not a weights format the engine runs; choose one of {', '.join(SCHEMES)}")


def _max_position(name: str) -> int:
    """The longest context the model was built for (its config's max_position_embeddings)."""
    from .models import TINY
    if name in TINY:
        return TINY[name].max_position
    from .models.config import ModelConfig
    from .models.registry import resolve
    return ModelConfig.load(resolve(name)).max_position


def _vocab(name: str) -> int:
    """The tokens the model's tokenizer knows: its engine's vocabulary, read without its weights."""
    from .models import TINY
    if name in TINY:
        return TINY[name].tokenizer_size
    from transformers import AutoTokenizer
    from .models.load import tokenizer_size
    from .models.registry import resolve
    return tokenizer_size(AutoTokenizer.from_pretrained(str(resolve(name))))


def _check_context(name: str, contexts: list[int], flag: str) -> None:
    """Contexts past the model's longest would only fail later, in an allocation or in RoPE."""
    top = _max_position(name)
    for n in contexts:
        if n > top:
            raise LabError(f"{flag} {n} is longer than {name} supports: at most {top} positions "
                           f"(its config's max_position_embeddings)")


def _check_vocab(target: str, draft: str | None) -> None:
    """A draft proposes the target's token ids, so the two must share one vocabulary."""
    if draft in (None, "lookup"):
        return
    tv, dv = _vocab(target), _vocab(draft)
    if tv != dv:
        raise LabError(f"the draft {draft}'s vocabulary ({dv} tokens) differs from the target {target}'s ({tv}): "
                       f"pick a draft with the target's tokenizer")


def _check_speculation(args) -> None:
    """Flags only speculative decoding reads are errors without a drafter, not silently ignored."""
    if args.draft and args.lookup:
        raise LabError("--draft and --lookup exclude each other: --lookup speculates with no draft model "
                       "(the automatic policy with --draft uses lookup as well)")
    given = [flag for flag, on in (("--gamma", args.gamma is not None), ("--threshold", args.threshold > 0),
                                   ("--policy", args.policy is not None)) if on]
    if given and not (args.draft or args.lookup):
        raise LabError(f"{' and '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to speculative "
                       f"decoding: add --draft MODEL or --lookup")
    if args.draft_vocab is not None and not args.draft:
        raise LabError("--draft-vocab trims a draft model: add --draft MODEL")
    fixed = [flag for flag in given if flag != "--policy"]
    if args.policy == "auto" and fixed:
        raise LabError(f"{' and '.join(fixed)} only {'applies' if len(fixed) == 1 else 'apply'} to --policy fixed: "
                       f"the automatic policy picks its own rounds")


def _check_fits(args, prompt_tokens: int, max_context: int) -> None:
    """The prompt, the new tokens and a round's guesses must fit the KV cache."""
    guesses = (args.gamma or profiles.max_k()) if (args.draft or args.lookup) else 0
    need = prompt_tokens + args.max_new_tokens + guesses
    if need > max_context:
        extra = f" and up to {guesses} guesses a round" if guesses else ""
        raise LabError(f"the prompt ({prompt_tokens} tokens), --max-new-tokens {args.max_new_tokens}{extra} need a "
                       f"context of {need}, more than --max-context {max_context}: raise --max-context or lower "
                       f"--max-new-tokens")


def _check_k(ks: list[int]) -> None:
    """One kernel call, and so one pass, takes at most the engine's MAX_K tokens."""
    top = profiles.max_k()
    if max(ks) > top:
        raise LabError(f"--k {max(ks)}: a kernel call takes 1 to {top} tokens (the engine's MAX_K)")


def _check_kernels(args) -> None:
    from .kernel_bench import DRAM_SHAPE
    unknown = [k for k in args.kernel if k not in DRAM_SHAPE]
    if unknown:
        raise LabError(f"--kernel {','.join(unknown)}: no such kernel; the kernels are {', '.join(DRAM_SHAPE)}")
    _check_k(args.k)


def _check_decode(args) -> None:
    _check_schemes(("--scheme", args.scheme))
    _check_context(args.model, [args.context], "--context")
    _check_k([args.k])


def _check_vk(args) -> None:
    if args.k is not None:
        _check_k(args.k)
        if 1 not in args.k:        # each v(k) is a ratio to the one-token pass of the same round
            raise LabError(f"--k {','.join(map(str, args.k))}: v(k) is measured against the one-token pass: "
                           f"include 1")
    _check_schemes(("--scheme", args.scheme))
    _check_context(args.model, args.context, "--context")
    _check_vocab(args.model, args.draft)


def _check_speculative(args) -> None:
    if args.policy == "auto" and args.gamma:
        raise LabError("--gamma only applies to --policy fixed: the automatic policy picks its own rounds "
                       "(up to --max-gamma)")
    _check_schemes(("--scheme", args.scheme), ("--draft-scheme", args.draft_scheme))
    _check_vocab(args.model, args.draft)
    if args.prompts and not Path(args.prompts).is_file():
        raise LabError(f"--prompts {args.prompts}: no such file (give a Spec-Bench-format JSONL)")


def _check_models(args) -> None:
    from .models import registry
    if args.action != "list" and not args.names:
        raise LabError(f"lab models {args.action} needs one or more model names; the lab knows: "
                       f"{', '.join(registry.REGISTRY)}")
    for name in args.names:
        if args.action == "fetch" or not Path(name).exists():     # folders and GGUF files are models too
            registry.spec(name)
    if args.action == "export":
        _check_schemes(("--scheme", args.scheme))


# ----------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------

def cmd_info(args) -> int:
    info = native.cpu()
    info["library"] = str(native.build())
    from . import protocol, tune
    info["memory"] = {"llc_bytes": protocol.llc_bytes(), "from_memory_bytes": protocol.past_llc(0)}
    info["tuning"] = tune.describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"CPU           {info['model']} ({info['vendor']}), {info['logical_cpus']} logical CPUs")
    print(f"flags         {' '.join(f for f, on in info['flags'].items() if on)}")
    print(f"kernel paths  {', '.join(info['supported_paths'])} (active: {info['active_path']})")
    for op, path in info["kernels"].items():
        print(f"  {op:22s}{path}")
    print(f"library       {info['library']}")
    mem = info["memory"]        # why the benchmarks allocate what they do
    print(f"caches        last level {mem['llc_bytes'] >> 20} MB (as Linux reports it); what is timed from memory "
          f"cycles through {mem['from_memory_bytes'] >> 20} MB at least")
    for line in tune.lines(info["tuning"]):
        print(line)
    warning = native.warn_if_slow()
    if warning:
        print(f"note          {warning}")
    return 0


def cmd_tune(args) -> int:
    from . import tune
    if args.ab:
        return cmd_tune_ab(args)
    r = tune.tune(progress=True, mb=args.mb)
    f = tune.save(r)
    if tune.skipped():
        print("lab: note: LAB_TUNE=0 is set: the kernels keep their defaults while it is", file=sys.stderr)
    else:
        tune.use(r)
    if note := tune.unsteady(r):
        print(f"lab: note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"measured in {r['seconds']:.0f} s on {r['cpu']} ({r['path']}, {r['threads']} threads, "
          f"{r['mb']} MB matrices); cached in {f}")
    print(f"{'choice':18s} {'candidate':>12s} {'time/default':>13s} {'IQR':>6s}")
    for stage, cands in r["measured"].items():
        for name, m in cands.items():
            mark = "  <- chosen" if name == r["chosen"][stage] else ""
            print(f"{stage:18s} {name:>12s} {m['ratio']:13.3f} {m['iqr']:6.3f}{mark}")
    for stage, tried in r["confirmed"].items():
        for c in tried:
            timed = c.get("rounds", r["rounds"])    # records from before a noisy head to head was timed twice
            print(f"{stage:18s} {c['candidate']:>12s} {c['ratio']:13.3f} {c['iqr']:6.3f}  "
                  f"(timed again against the default, {timed} rounds)")
    return 0


def cmd_tune_ab(args) -> int:
    from . import tune, tune_ab
    from .engine import Engine
    from .machine import machine
    from .models.export import engine_file
    _check_k(args.k)
    _check_schemes(("--scheme", args.scheme))
    _check_context(args.model, args.context, "--context")
    rec = tune.load()
    if rec is None:
        raise LabError("nothing is tuned for this CPU, kernel path and build yet: run `lab tune` first")
    e = Engine(engine_file(args.model, args.scheme), threads=args.threads,
               max_context=max(args.context) + max(args.k) + 64)
    r = tune_ab.ab(e, args.context, args.k, rec["values"], rounds=args.rounds, progress=not args.json)
    r = {"machine": machine(), "model": args.model, "format": args.scheme, "threads": e.pool.threads,
         "tuned_at": rec["date"], **r}
    _emit(args, r, _print_tune_ab)
    return 1 if r["slower"] else 0


def _print_tune_ab(r: dict) -> None:
    changed = ", ".join(f"{f} {a} -> {b}" for f, (a, b) in r["changed"].items()) or "none (the defaults)"
    print(f"tuned at {r['tuned_at']} on {r['machine']['cpu']}: {changed}")
    if not r["changed"]:
        print("the tuned values are the defaults: both sides run the same code, so the ratios show the noise")
    print(f"{r['model']} ({r['format']}), {r['threads']} threads, {r['rounds']} rounds, passes alternating A B B A")
    print(f"{'context':>7s} {'k':>3s} {'default ms':>11s} {'tuned ms':>9s} {'tuned/default':>14s} {'IQR':>13s}"
          f" {'v(k) default':>13s} {'tuned':>6s}")
    for x in r["results"]:
        v = f"{x['v_default']:13.3f} {x['v_tuned']:6.3f}" if "v_default" in x else ""
        mark = ("  slower" if x["slower"] else "  slower in too few rounds to tell" if x.get("undecided")
                else "  same code" if x.get("same_code") and r["changed"] else "")
        print(f"{x['context']:7d} {x['k']:3d} {x['default_ms']:11.2f} {x['tuned_ms']:9.2f} {x['ratio']:14.3f}"
              f" {x['q1']:6.3f}-{x['q3']:6.3f} {v}{mark}")
    if r["changed"] and any(x.get("same_code") for x in r["results"]):
        print("same code: the tuned values change no kernel of that pass, so its ratio shows the noise")
    where = lambda xs: ", ".join(f"context {s['context']} k {s['k']}" for s in xs)
    undecided = r.get("undecided") or []
    print("slower: " + (where(r["slower"]) if r["slower"] else
                        f"none shown, but {where(undecided)} read slower in too few of {r['rounds']} rounds to tell: "
                        "run again with more --rounds" if undecided else
                        "none: the tuned values are not slower on any figure"))


def _print_bandwidth(r: dict) -> None:
    w = max(len(x["kind"]) for x in r["results"])
    print(f"{'kind':{w}s} {'threads':>7s} {'GB/s':>8s} {'IQR':>6s}")
    for x in sorted(r["results"], key=lambda x: (x["kind"], x["threads"])):
        print(f"{x['kind']:{w}s} {x['threads']:7d} {x['gbps']:8.1f} {x['gbps_iqr']:6.1f}")
    print(f"read ceiling: {r['read_gbps']:.1f} GB/s (IQR {r['read_gbps_iqr']:.1f}) "
          f"at {r['threads']} threads, {r['buffer_mb']} MB buffer")


def _print_kernels(r: dict) -> None:
    print(f"path {r['path']}, read ceiling {r['read_gbps']:.1f} GB/s, "
          f"dot peak {r['dot_peak_gmacs']:.0f} GMAC/s per thread ({r['dot_peak_variant']}); tuning: {r['tuning']}")
    print(f"{'kernel':6s} {'set':4s} {'k':>3s} {'thr':>3s} {'ms':>9s} {'ms/tok':>9s} {'GMAC/s':>8s} "
          f"{'GB/s':>6s} {'%bw':>5s} {'%peak':>6s}")
    for x in r["results"]:
        bw = f"{100 * x['share_of_bandwidth']:5.0f}"
        print(f"{x['kernel']:6s} {x['working_set']:4s} {x['k']:3d} {x['threads']:3d} {x['ms']:9.3f} "
              f"{x['ms_per_token']:9.3f} {x['gmacs']:8.1f} {x['gbps']:6.1f} {bw} {100 * x['share_of_peak']:6.0f}")
    print("%bw: of the read ceiling (DRAM rows: paired with read passes in the same rounds); "
          "%peak: of the dot-product issue peak")
    att = r["attention"]
    print(f"attention alone, one thread (head_dim {att[0]['head_dim']}, {att[0]['group']} query heads a KV head, "
          f"cache-resident, {att[0]['products']} products):")
    print(f"{'context':>7s} {'k':>3s} {'us':>8s} {'GMAC/s':>8s}")
    for x in att:
        print(f"{x['context']:7d} {x['k']:3d} {x['us']:8.1f} {x['gmacs']:8.1f}")


def _print_decode(r: dict) -> None:
    passes = f"{r['k']}-token passes of {r['ms_per_pass']:.1f} ms: " if r["k"] > 1 else ""
    print(f"{r['model']} ({r['format']}, {r['attention']} attention), {r['threads']} threads, context {r['context']}: {passes}"
          f"{r['tokens_per_s']:.1f} tokens/s ({r['ms_per_token']:.1f} ms/token)")
    print(f"{r['bytes_per_pass'] / 1e6:.0f} MB read per pass = {r['gbps']:.1f} GB/s; read ceiling "
          f"{r['read_gbps']:.1f} GB/s; share {100 * r['share_of_ceiling']:.0f}% (IQR {100 * r['share_of_ceiling_iqr']:.0f})")
    trip = r.get("round_trip_ns") or {}
    if trip.get("before"):
        print(f"threads 0 and 1: a cache line's round trip {trip['before']:.0f} ns before, {trip['after']:.0f} after "
              "(several times longer across dies, where each die has its own link to memory)")
    if "stages" in r:
        print(f"{'stage':10s} {'ms':>7s} {'part':>5s} {'MB':>6s} {'GB/s':>6s} {'%ceil':>6s}")
        for x in r["stages"]:
            mb = f"{x['bytes'] / 1e6:6.0f}" if x["bytes"] else f"{'':6s}"
            rate = f"{x['gbps']:6.1f} {100 * x['share_of_ceiling']:6.0f}" if x["bytes"] else ""
            print(f"{x['stage']:10s} {x['ms']:7.3f} {100 * x['part']:4.0f}% {mb} {rate}")
        m = r["matrices"]
        print(f"the matrices alone read {100 * m['share_of_ceiling']:.0f}% of the ceiling; the work between them "
              f"takes {m['between_ms']:.2f} ms a pass ({100 * m['between_part']:.0f}%)")


def _v_text(x: dict) -> str:
    """v(k) with its spread over rounds: a few rounds' v(2) moves by several percent on a shared bus."""
    iqr = f" (IQR {x['v_iqr']:.2f})" if x["k"] > 1 and "v_iqr" in x else ""
    return f"v({x['k']})={x['v']:.2f}{iqr}"


def _print_vk(r: dict) -> None:
    from .protocol import steady
    print(f"target {r['target']}, draft {r['draft']}, {r['format']}, {r['attention']} attention, {r['threads']} threads")
    for ctx in sorted({x["context"] for x in r["records"]}):
        vs = [x for x in r["records"] if x["context"] == ctx and x["kind"] == "v"]
        read = f"read ceiling {vs[0]['read_gbps_before']:.0f} GB/s before, {vs[0]['read_gbps_after']:.0f} after"
        if vs[0].get("round_trip_ns"):
            read += f"; threads {vs[0]['round_trip_ns']:.0f} ns apart"
        if not steady(vs[0]["read_gbps_before"], vs[0]["read_gbps_after"]):
            read += "; the bus changed state meanwhile, so these mix its two states"
        print(f"context {ctx} ({read}): " + " ".join(_v_text(x) for x in vs))
        for x in r["records"]:
            if x["context"] == ctx and x["kind"] == "c":
                print(f"  c({x['format']}) = {x['c']:.3f} (IQR {x['c_iqr']:.3f})")
    print(f"o = {r['o']:.4f} of a target step (greedy); sampled: {r['overhead']['o_sampled']:.4f}")


def _emit(args, r: dict, show) -> int:
    """A bench's result: JSON for other tools under --json, else show's table for people."""
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        show(r)
    return 0


def _named(r: dict, **names) -> dict:
    """A bench's result with the names of what it measured after its machine: benches take
    engines, which do not know the names they were loaded by."""
    return {**dict(list(r.items())[:1]), **names, **r}


def cmd_bench_bandwidth(args) -> int:
    from .ceilings import bandwidth
    return _emit(args, bandwidth(threads=args.threads, mb=args.mb, rounds=args.rounds), _print_bandwidth)


def cmd_bench_kernels(args) -> int:
    from .kernel_bench import kernels_bench
    _check_kernels(args)
    r = kernels_bench(ks=tuple(args.k), fmts=tuple(args.kernel), threads=args.threads, quick=args.quick,
                      path=args.path)
    return _emit(args, r, _print_kernels)


def cmd_bench_decode(args) -> int:
    from .engine import Engine
    from .models.export import engine_file
    from .steps import decode_bench
    _check_decode(args)
    e = Engine(engine_file(args.model, args.scheme), threads=args.threads, max_context=max(args.context + 64, 512),
               attention=args.attention)
    r = decode_bench(e, args.context, rounds=args.rounds, stages=args.stages, k=args.k)
    return _emit(args, _named(r, model=args.model, format=args.scheme, attention=e.attention), _print_decode)


VK_DRAFT_SCHEMES = ("q4-q8out", "q8")      # the draft formats whose c lab bench vk measures


def cmd_bench_vk(args) -> int:
    from .costs import vk_bench
    from .engine import Engine
    from .kernels import Pool
    from .models.export import engine_file
    from .policy import CONTEXTS
    args.context = args.context or list(CONTEXTS)
    _check_vk(args)
    ks = tuple(args.k or range(1, profiles.max_k() + 1))     # the default needs the engine, so only now
    draft = None if args.draft == "lookup" else args.draft
    pool = Pool(args.threads)
    top = max(args.context) + max(ks) + 64
    target = Engine(engine_file(args.model, args.scheme), pool=pool, max_context=top, attention=args.attention)
    # o is measured with the first draft: the one in the target's format, where there is one
    schemes = sorted(VK_DRAFT_SCHEMES, key=lambda s: s != args.scheme) if draft else []
    drafts = {s: Engine(engine_file(draft, s), pool=pool, max_context=top, attention=args.attention) for s in schemes}
    r = vk_bench(target, drafts, tuple(args.context), ks, rounds=args.rounds, progress=not args.json)
    return _emit(args, _named(r, target=args.model, draft=draft, format=args.scheme, attention=target.attention),
                 _print_vk)


def _draft_engine(args, pool, max_context: int):
    """The draft Engine the flags name (None for "lookup"): stock, or trimmed to --draft-vocab tokens."""
    from .engine import Engine
    from .models.export import engine_file
    if args.draft in (None, "lookup"):
        return None
    from .vocab import default_n, trimmed_draft_file
    n = default_n(args.draft) if args.draft_vocab is None else args.draft_vocab
    if n:
        f = trimmed_draft_file(args.draft, args.model, n, args.draft_vocab_format, args.draft_scheme)
    else:
        f = engine_file(args.draft, args.draft_scheme)
    return Engine(f, pool=pool, max_context=max_context)


def cmd_bench_speculative(args) -> int:
    from . import policy, speculative
    from .machine import commit, machine
    from .engine import Engine
    from .kernels import Pool
    from .models.export import engine_file
    _check_speculative(args)
    prompts = speculative.prompts_from(args.prompts, args.per_group)     # a bad file fails before the models load
    pool = Pool(args.threads)
    target = Engine(engine_file(args.model, args.scheme), pool=pool, max_context=4096)
    draft = _draft_engine(args, pool, 4096)
    gammas = args.gamma or [4]
    pol_name = args.policy or ("fixed" if args.gamma else "auto")
    chosen = speculative.settings(args.draft, pol_name, gammas)
    costs = policy.costs_for(target, draft, fresh=args.fresh_costs)
    pol = None
    if pol_name == "auto":
        pol = policy.fitted_policy(target, draft, args.model, args.temperature, args.max_gamma, refit=args.calibrate)
    # the progress bar goes to stderr, so it shows with --json too
    res = speculative.run(target, {"draft": draft}, prompts, chosen, args.max_new_tokens, args.temperature,
                          args.seed, {"draft": costs}, {"draft": pol}, args.model, progress=True,
                          measure_costs=lambda: {"draft": policy.measure_costs(target, draft, progress=False)})
    res = {"machine": machine(), "commit": commit(), "target": args.model, "draft": args.draft,
           "draft_file": str(draft.file) if draft is not None else None, "policy": pol_name,
           "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "threads": pool.threads,
           "costs": costs.model_dump(), **res}
    if args.json:
        print(speculative.dump(res))
    else:
        speculative.print_summary(res)
    return 0


def cmd_models(args) -> int:
    from .models import registry
    _check_models(args)
    if args.action == "list":
        rows = [registry.status(n) for n in registry.REGISTRY]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"cache: {registry.models_dir()}")
        for r in rows:
            size = f"{r['size'] / 1e6:9.1f} MB" if r["size"] else " " * 12
            state = "present" if r["present"] else "absent"
            check = " sha256 ok" if r["verified"] else ""
            print(f"{r['name']:20s} {state:8s}{size}{check}  {r['description']}")
        return 0
    if args.action == "compare":
        from .models.compare import against_transformers
        for name in args.names:
            print(json.dumps(against_transformers(name)))
        return 0
    if args.action == "ppl":
        from .models import perplexity as P
        from .models.load import load
        for name in args.names:
            m = load(name)
            if m.tokenizer is None:
                raise LabError(f"{name} has no tokenizer: perplexity needs a real model (lab models list)")
            ids = m.tokenizer(P.stdlib_text())["input_ids"]
            for row in P.table(m.config, m.weights, ids, window=args.window, count=args.windows, progress=True):
                print(json.dumps({"model": name, **row}), flush=True)
        return 0
    if args.action == "export":
        from .models.export import engine_file
        for name in args.names:
            if args.draft_vocab:
                from .vocab import trimmed_draft_file
                if not args.target:
                    raise LabError("a trimmed draft is ranked for a target: add --for TARGET")
                f = trimmed_draft_file(name, args.target, args.draft_vocab, args.draft_vocab_format, args.scheme)
            else:
                f = engine_file(name, args.scheme)
            print(f"{name}: {f}")
        return 0
    for name in args.names:
        print(f"{name}: {registry.fetch(name)}")
    return 0


def _prompt_ids(model: str, prompt: str, chat: bool):
    """Token ids of the prompt (with the chat template) and the tokenizer; tiny models take ids."""
    from .models import TINY
    if model in TINY:
        try:
            return [int(t) for t in prompt.split()], None
        except ValueError:
            raise LabError(f"{model} has no tokenizer: give the prompt as token ids, e.g. '1 2 3'") from None
    from transformers import AutoTokenizer
    from .models.registry import resolve
    tok = AutoTokenizer.from_pretrained(str(resolve(model)))
    if not chat:
        return tok(prompt)["input_ids"], tok
    extra = {"enable_thinking": False} if model.startswith("qwen3") else {}
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=False, **extra)
    return tok(text, add_special_tokens=False)["input_ids"], tok


class _Stream:
    """Prints text as tokens arrive, decoding the whole tail so multi-byte characters come out whole."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], ""

    def __call__(self, t: int):
        self.ids.append(t)
        text = self.tok.decode(self.ids, skip_special_tokens=True) if self.tok else " ".join(map(str, self.ids))
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[len(self.shown):])
        sys.stdout.flush()
        self.shown = text


def cmd_generate(args) -> int:
    from .engine import Engine
    from .kernels import Pool
    from .models.export import engine_file
    _check_speculation(args)
    _check_schemes(("--scheme", args.scheme), ("--draft-scheme", args.draft_scheme))
    max_context = args.max_context or min(DEFAULT_MAX_CONTEXT, _max_position(args.model))
    _check_context(args.model, [max_context], "--max-context")
    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    ids, tok = _prompt_ids(args.model, prompt, not args.raw)
    _check_fits(args, len(ids), max_context)
    _check_vocab(args.model, args.draft)
    pool = Pool(args.threads)
    target = Engine(engine_file(args.model, args.scheme), pool=pool, max_context=max_context)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, on_token=_Stream(tok))
    if args.draft or args.lookup:
        draft = "lookup" if args.lookup else _draft_engine(args, pool, max_context)
        policy = args.policy or ("fixed" if args.gamma or args.threshold else "auto")
        if policy == "auto" and args.lookup:
            draft = None                        # the automatic policy with lookup alone
        r = target.speculate(ids, draft, gamma=args.gamma, threshold=args.threshold, policy=policy, **kw)
    else:
        r = target.generate(ids, **kw)
    sys.stdout.write("\n")
    s = r.summary()
    lines = [f"prompt: {s['prompt_tokens']} tokens, {s['prompt_tokens_per_s']:.1f} tokens/s",
             f"generation: {s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tokens/s"]
    if args.draft or args.lookup:
        lines.append(f"rounds: {s['rounds']} ({', '.join(f'{r.kinds.count(k)} {k}' for k in ('draft', 'lookup', 'plain'))}), "
                     f"{s['tokens_per_round']:.2f} tokens/round, acceptance "
                     f"{s['accepted']}/{s['drafted']} = {s['acceptance']:.3f}")
    lines.append("time: prompt {t_prompt:.3f}s, draft {t_draft:.3f}s, verify {t_verify:.3f}s, "
                 "sampling {t_sample:.3f}s, total {t_total:.3f}s".format(**s))
    print("\n".join(lines), file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    from . import profiles, runner
    if args.on and not args.scheduler:
        raise LabError(f"--on {args.on} only applies to a cluster: add --scheduler ADDRESS or --scheduler local[:N]")
    if args.scheduler:
        from . import cluster
        page, entries = cluster.run(args.notebooks or None, args.profile, profiles.parse_set(args.set), args.out,
                                    args.scheduler, args.on or "any")
        print(page)
        return 1 if any(e["status"] != "ok" for e in entries) else 0
    index = runner.run(args.notebooks or None, args.profile, profiles.parse_set(args.set), args.out)
    entries = json.loads((index.parent / "index.json").read_text())["entries"]
    print(index)
    return 1 if any(e["status"] != "ok" for e in entries if e["notebook"] in (args.notebooks or profiles.notebooks())) else 0


def _print_baseline(r: dict) -> None:
    print(f"{r['threads']} threads; llama.cpp: {r['llama_cpp'] or 'left out (' + r['llama_absent'] + ')'}")
    print(f"{'system':10s} {'context':>7s} {'tok/s':>7s} {'GB/s':>6s} {'%ceil':>6s} {'v(2)':>5s} {'v(4)':>5s} {'v(8)':>5s}")
    for x in r["steps"]:
        print(f"{x['system']:10s} {x['context']:7d} {x['tokens_per_s']:7.1f} {x['gbps']:6.1f} "
              f"{100 * x['share_of_ceiling']:6.0f} {x['v'][2]:5.2f} {x['v'][4]:5.2f} {x['v'][8]:5.2f}")
    print(f"{'system':18s} {'setting':12s} {'n':>3s} {'tok/s':>7s} {'speedup':>8s} {'vs llama.cpp':>12s} {'equal':>5s}")
    for x in r["generation"]["summary"]:
        if x["group"] == "overall":
            print(f"{x['system']:18s} {x['setting']:12s} {x['n']:3d} {x['tokens_per_s']:7.1f} {x['speedup']:8.2f} "
                  f"{x['vs_reference']:12.2f} {str(x['all_equal']):>5s}")


def cmd_bench_baseline(args) -> int:
    from .baselines import llamacpp, study, systems
    from .machine import commit, machine
    from .vocab import default_n
    _check_vocab(args.model, args.draft)
    _check_schemes(("--scheme", args.scheme))
    if set(args.hf_dtype) - {"fp32", "bf16"}:
        raise LabError(f"--hf-dtype {','.join(args.hf_dtype)}: transformers runs in fp32 or bf16")
    n = default_n(args.draft) if args.draft_vocab is None else args.draft_vocab
    s = systems.setup(args.model, args.draft, args.scheme, n, args.threads)
    steps = study.steps(s.target, s.llama, args.context, range(1, (args.max_k or profiles.max_k()) + 1), args.rounds)
    chosen = systems.chosen(s, args.model, args.draft, args.max_new_tokens, args.llama_gamma, args.lookup_gamma,
                            args.hf_dtype if args.hf_prompts else [], args.hf_prompts)
    gen = study.generation(chosen, study.prompts_for(args.model, args.per_group))
    r = {"machine": machine(), "commit": commit(), "target": args.model, "draft": args.draft, "draft_vocab": n,
         "threads": s.pool.threads, "llama_cpp": s.llama and llamacpp.version(), "llama_absent": s.absent,
         "max_new_tokens": args.max_new_tokens, "hf_prompts": args.hf_prompts, "steps": steps, "generation": gen}
    return _emit(args, r, _print_baseline)


def cmd_worker(args) -> int:
    from . import cluster
    return cluster.serve(args.address, args.name)


def _draft_flags(p, default: str | None = None, text: str = "a draft model for speculative decoding") -> None:
    p.add_argument("--draft", default=default, help=text)
    p.add_argument("--draft-scheme", default="q4-q8out", help="the draft's weights format (default q4-q8out)")
    p.add_argument("--draft-vocab", type=_DRAFT_VOCAB, default=None,
                   help="the draft's output trimmed to N tokens (default: lab.vocab.DEFAULT_N; 0: stock)")
    p.add_argument("--draft-vocab-format", default="q4", choices=["q4", "q8"])


def _kernel_path(s: str) -> str:
    """An argparse type: a kernel path's name, as the engine names them (read only when given)."""
    if s not in native.consts().paths:
        raise argparse.ArgumentTypeError(f"{s!r} is not a kernel path; use one of {', '.join(native.consts().paths)}")
    return s


TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"      # the benches' models unless told


def _bench_command(benches, name: str, text: str, fn, threads: str | None = "one", rounds: bool = True):
    """A `lab bench NAME` parser with the flags benches share, written once: --json, and --threads
    ("one" count, a "list" of counts or None) and --rounds where the bench takes them."""
    p = benches.add_parser(name, help=text, description=text)
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    if threads == "list":
        p.add_argument("--threads", type=_list(_THREADS), metavar="N,...",
                       help="thread counts, e.g. 1,2 (default: 1 to every CPU this process may use)")
    elif threads == "one":
        p.add_argument("--threads", type=_THREADS, metavar="N", help="threads (default: every CPU this process may use)")
    if rounds:
        p.add_argument("--rounds", type=_COUNT, default=5, metavar="N", help="interleaved rounds (default 5)")
    p.set_defaults(fn=fn)
    return p


def _target_flags(p) -> None:
    p.add_argument("--model", default=TARGET, help="the target model (default %(default)s)")
    p.add_argument("--scheme", default="q4-q8out", help="its weights format: f32, q8, q4 or q4-q8out (default)")


def _attention_flag(p) -> None:
    p.add_argument("--attention", choices=["f32", "bf16", "amx"],
                   help="attention's products (default: amx, else bf16, where the kernel path has it, else f32)")


def _add_bandwidth(benches) -> None:
    p = _bench_command(benches, "bandwidth", "read, copy and triad bandwidth against thread count: the read ceiling",
                       cmd_bench_bandwidth, threads="list")
    p.add_argument("--mb", type=_COUNT, default=512, metavar="N",
                   help="buffer size in MB, at least: raised to twice the last-level cache (default 512)")


def _add_kernels(benches) -> None:
    p = _bench_command(benches, "kernels", "each kernel and k against the read ceiling and the dot-product issue peak",
                       cmd_bench_kernels, rounds=False)
    p.add_argument("--k", type=_list(_COUNT), default=[1, 2, 4, 8, 16], metavar="K,...",
                   help="tokens per call, e.g. 1,4 (default 1,2,4,8,16; at most the engine's MAX_K)")
    p.add_argument("--kernel", type=_list(str), default=["q4", "q8"], metavar="FORMAT,...",
                   help="weights formats (default q4,q8)")
    # read only when given: the kernel paths' names come from the native library
    p.add_argument("--path", type=_kernel_path, help="force a kernel path: scalar, avx2, avxvnni, avx512vnni")
    p.add_argument("--quick", action="store_true", help="smaller matrices and fewer repeats")


def _add_decode(benches) -> None:
    p = _bench_command(benches, "decode", "one-token decode steps: tokens/s and share of the read ceiling",
                       cmd_bench_decode)
    _target_flags(p)
    p.add_argument("--context", type=_COUNT, default=256, metavar="N",
                   help="the one context the steps run at (default 256; lab bench vk takes several)")
    p.add_argument("--stages", action="store_true", help="time each stage of the pass too")
    p.add_argument("--k", type=_COUNT, default=1, metavar="K",
                   help="tokens per pass (default 1; more: a verification pass, whose stages show what grows with k)")
    _attention_flag(p)


def _add_vk(benches) -> None:
    p = _bench_command(benches, "vk", "v(k), c and o: the costs speculative decoding is predicted from", cmd_bench_vk)
    _target_flags(p)
    p.add_argument("--draft", default=DRAFT, help="the draft whose c is measured (default %(default)s; 'lookup': none)")
    p.add_argument("--context", type=_list(_COUNT), metavar="N,...",
                   help="contexts, e.g. 256,2048 (default: those the policy's cost table is measured at)")
    p.add_argument("--k", type=_list(_COUNT), metavar="K,...",
                   help="tokens per pass, 1 among them, e.g. 1,2,4 (default: 1 to the engine's MAX_K)")
    _attention_flag(p)


def _add_speculative(benches) -> None:
    p = _bench_command(benches, "speculative", "speculative against plain decoding on Spec-Bench-format prompts",
                       cmd_bench_speculative, rounds=False)
    _target_flags(p)
    _draft_flags(p, DRAFT, "the draft model (default %(default)s; 'lookup': prompt lookup, no draft model)")
    p.add_argument("--prompts", help="a Spec-Bench-format JSONL (default: the shipped dev set)")
    p.add_argument("--per-group", type=_COUNT, help="prompts per group (default: all)")
    p.add_argument("--max-new-tokens", type=_COUNT, default=128)
    p.add_argument("--policy", choices=["fixed", "auto"], help="auto unless --gamma is given")
    p.add_argument("--gamma", type=_list(_GAMMA), metavar="G,...", help="fixed guesses per round, e.g. 1,2,4")
    p.add_argument("--max-gamma", type=_GAMMA, default=8, help="the automatic policy's longest round (default 8)")
    p.add_argument("--temperature", type=_TEMPERATURE, default=0.0)
    p.add_argument("--seed", type=_SEED, default=0)
    p.add_argument("--calibrate", action="store_true", help="fit the policy's calibration again")
    p.add_argument("--fresh-costs", action="store_true",
                   help="measure this machine's costs now, not from the cache, so predictions pair in time")


def _add_baseline(benches) -> None:
    p = _bench_command(benches, "baseline", "the lab beside llama.cpp and transformers: decode, v(k), and plain "
                       "and speculative generation on Spec-Bench prompts, paired in one run", cmd_bench_baseline)
    _target_flags(p)
    p.add_argument("--draft", default=DRAFT, help="the draft model for every system (default %(default)s)")
    p.add_argument("--draft-vocab", type=_DRAFT_VOCAB, default=None,
                   help="the lab's draft trimmed to N tokens (default: lab.vocab.DEFAULT_N; 0: stock)")
    p.add_argument("--context", type=_list(_COUNT), default=[256, 2048], metavar="N,...",
                   help="contexts of the decode and v(k) passes (default 256,2048)")
    p.add_argument("--max-k", type=_GAMMA, metavar="K", help="v(k) for k = 1..K (default: the engine's MAX_K)")
    p.add_argument("--per-group", type=_COUNT, default=2, help="prompts per Spec-Bench group (default 2)")
    p.add_argument("--max-new-tokens", type=_COUNT, default=64)
    p.add_argument("--llama-gamma", type=_list(_GAMMA), default=[2, 4], metavar="G,...",
                   help="llama.cpp's draft/verify rounds of G guesses (default 2,4)")
    p.add_argument("--lookup-gamma", type=_list(_GAMMA), default=[4], metavar="G,...",
                   help="llama.cpp's prompt lookup rounds (default 4)")
    p.add_argument("--hf-dtype", type=_list(str), default=["fp32", "bf16"], metavar="DTYPE,...",
                   help="transformers' dtypes: fp32, bf16 (default both)")
    p.add_argument("--hf-prompts", type=_number(int, Range(0)), default=3, metavar="N",
                   help="transformers runs on the first N prompts only (default 3; 0: not at all)")


def _add_tune(sub) -> None:
    t = sub.add_parser("tune", help="measure the kernels' speed-only choices on this CPU and cache them",
                       description="Times each candidate prefetch distance, two-token scheme and split threshold "
                                   "against the default (interleaved) and caches the choices beside the native "
                                   "build; the engine applies them on load (LAB_TUNE=0: the defaults).")
    t.add_argument("--json", action="store_true", help="print machine-readable results")
    t.add_argument("--mb", type=_COUNT, default=64, metavar="N",
                   help="MB of each matrix timed at a time, cycling through matrices twice the last-level "
                        "cache, so they stream from memory (default 64)")
    g = t.add_argument_group("--ab: the cached tuning against the defaults on whole passes, alternating; "
                             "exits 1 when the tuned values are slower on any figure")
    g.add_argument("--ab", action="store_true", help="compare instead of tuning")
    _target_flags(g)
    g.add_argument("--context", type=_list(_COUNT), default=[256, 2048], metavar="N,...",
                   help="contexts (default 256,2048)")
    g.add_argument("--k", type=_list(_COUNT), default=[1, 2, 4, 8], metavar="K,...",
                   help="tokens per pass (default 1,2,4,8; v(k) needs 1 among them)")
    g.add_argument("--rounds", type=_COUNT, default=10, metavar="N", help="alternating rounds (default 10)")
    g.add_argument("--threads", type=_THREADS, metavar="N", help="threads (default: every CPU this process may use)")
    t.set_defaults(fn=cmd_tune)


def _add_bench(sub) -> None:
    """`lab bench NAME`: another bench is a cmd_bench_NAME, an _add_NAME and its entry below."""
    b = sub.add_parser("bench", help="measurements: bandwidth, kernels, decode, vk, speculative, baseline",
                       description="Measurements; each bench has its own flags (lab bench NAME --help).")
    # no dest: a missing bench is then reported by the list of benches, in argparse's one line
    benches = b.add_subparsers(title="benches", required=True)
    for add in (_add_bandwidth, _add_kernels, _add_decode, _add_vk, _add_speculative, _add_baseline):
        add(benches)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lab", description="Speculative decoding on a CPU: the lab's command.")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the content-hash check of weights files on their first load: a corrupt or "
                        "altered file then gives wrong numbers instead of an error (sets LAB_VERIFY=0)")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="this CPU, its kernel paths and the native build")
    info.add_argument("--json", action="store_true")
    info.set_defaults(fn=cmd_info)
    _add_tune(sub)

    r = sub.add_parser("run", help="execute notebooks with papermill into HTML reports and an index")
    r.add_argument("notebooks", nargs="*", help="notebook names (default: all)")
    r.add_argument("--profile", default="quick", help="a profile in params/ (quick, default, qwen3) or a .yaml path")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a parameter")
    r.add_argument("--out", help="output folder (default: outputs/<profile>)")
    r.add_argument("--scheduler", type=_scheduler, metavar="ADDRESS",
                   help="run on a Dask cluster: its scheduler (tcp://HOST:8786), or local[:N] for N worker "
                        "processes on this machine (default 2); outputs go to <out>/<machine>/ and machines.html")
    r.add_argument("--on", choices=["any", "each"],
                   help="with --scheduler: any (default) spreads the notebooks over the machines; each runs "
                        "them all on every machine")
    r.set_defaults(fn=cmd_run)

    w = sub.add_parser("worker", help="serve a Dask scheduler as one machine for lab run --scheduler")
    w.add_argument("address", help="the scheduler, e.g. tcp://HOST:8786")
    w.add_argument("--name", help="this machine's name in the outputs (default: its host name)")
    w.set_defaults(fn=cmd_worker)

    m = sub.add_parser("models", help="the models the lab knows: list, fetch")
    m.add_argument("action", choices=["list", "fetch", "export", "compare", "ppl"],
                   help="compare: the reference against transformers; ppl: perplexity per format")
    m.add_argument("names", nargs="*", help="models to act on")
    m.add_argument("--window", type=_COUNT, default=256, help="ppl: tokens per window")
    m.add_argument("--windows", type=_COUNT, default=8, help="ppl: how many windows")
    m.add_argument("--scheme", default="q4-q8out", help="export: f32, q8, q4 or q4-q8out")
    m.add_argument("--draft-vocab", type=_DRAFT_VOCAB, help="export: a draft trimmed to N output tokens (needs --for)")
    m.add_argument("--draft-vocab-format", default="q4", choices=["q4", "q8"])
    m.add_argument("--for", dest="target", help="export --draft-vocab: the target it drafts for")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_models)

    g = sub.add_parser("generate", help="generate text: streamed to stdout, statistics to stderr")
    g.add_argument("prompt", help="the prompt ('-' reads stdin; token ids for tiny models)")
    g.add_argument("--model", default="qwen2.5-coder-1.5b")
    g.add_argument("--scheme", default="q4-q8out", help="weights format: f32, q8, q4, q4-q8out")
    _draft_flags(g)
    g.add_argument("--lookup", action="store_true", help="speculate with prompt lookup (no draft model)")
    g.add_argument("--policy", choices=["fixed", "auto"],
                   help="auto (the default): each round picks lookup, the draft or neither, and how many "
                        "guesses; fixed: --gamma guesses a round (the default when --gamma is given)")
    g.add_argument("--gamma", type=_GAMMA,
                   help="fixed guesses per round (1 to the engine's MAX_K; 4 under --policy fixed)")
    g.add_argument("--threshold", type=_number(float, Range(0, 1, why="a probability")), default=0.0,
                   help="draft stops when its top probability is below")
    g.add_argument("--max-new-tokens", type=_COUNT, default=256)
    g.add_argument("--temperature", type=_TEMPERATURE, default=0.0)
    g.add_argument("--top-k", type=_number(int, Range(0, why="0: every token")), default=0)
    g.add_argument("--top-p", type=_number(float, Range(0, 1, gt=True)), default=1.0)
    g.add_argument("--seed", type=_SEED, default=0)
    g.add_argument("--threads", type=_THREADS)
    g.add_argument("--max-context", type=_COUNT,
                   help=f"KV cache length in tokens (default {DEFAULT_MAX_CONTEXT}, or the model's longest if shorter)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.set_defaults(fn=cmd_generate)

    add_results_parser(sub)
    _add_bench(sub)
    return p


def _one_line(e: BaseException) -> str:
    """The error in one line: the lab's own errors say what to do; any other names its type."""
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    if isinstance(e, LabError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:                     # argparse has printed its one line (or --help)
        return e.code if isinstance(e.code, int) else 2
    if args.no_verify:                          # the environment reaches notebooks' kernels too
        os.environ["LAB_VERIFY"] = "0"
        print("lab: note: --no-verify: weights files' content hashes are not checked", file=sys.stderr)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("lab: interrupted", file=sys.stderr)
        return 130
    except Exception as e:                      # noqa: BLE001 - one line for the user; LAB_DEBUG=1 for us
        if os.environ.get("LAB_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        else:
            print(f"lab: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
