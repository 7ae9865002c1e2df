"""The `lab` command.

  lab info                       this CPU, its kernel paths, and the native build
  lab models list|fetch NAME     the models the lab knows; get one into the cache
  lab run [NOTEBOOK...]          notebooks -> HTML reports under a profile (papermill)
  lab bench bandwidth [--json]   read (and copy/triad) bandwidth against thread count
  lab bench kernels [--json]     each kernel and k against the read ceiling and issue peak
"""
from __future__ import annotations

import argparse
import json
import sys

from .errors import LabError


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")


def cmd_info(args) -> int:
    from . import native
    info = native.cpu()
    info["library"] = str(native.build())
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"CPU           {info['model']} ({info['vendor']}), {info['logical_cpus']} logical CPUs")
    print(f"flags         {' '.join(f for f, on in info['flags'].items() if on)}")
    print(f"kernel paths  {', '.join(info['supported_paths'])} (active: {info['active_path']})")
    for op, path in info["kernels"].items():
        print(f"  {op:22s}{path}")
    print(f"library       {info['library']}")
    warning = native.warn_if_slow()
    if warning:
        print(f"note          {warning}")
    return 0


def _print_bandwidth(r: dict) -> None:
    print(f"{'kind':6s} {'threads':>7s} {'GB/s':>8s} {'IQR':>6s}")
    for x in sorted(r["results"], key=lambda x: (x["kind"], x["threads"])):
        print(f"{x['kind']:6s} {x['threads']:7d} {x['gbps']:8.1f} {x['gbps_iqr']:6.1f}")
    print(f"read ceiling: {r['read_gbps']:.1f} GB/s (IQR {r['read_gbps_iqr']:.1f}) "
          f"at {r['threads']} threads, {r['buffer_mb']} MB buffer")


def _print_kernels(r: dict) -> None:
    print(f"path {r['path']}, read ceiling {r['read_gbps']:.1f} GB/s, "
          f"dot peak {r['dot_peak_gmacs']:.0f} GMAC/s per thread")
    print(f"{'kernel':6s} {'set':4s} {'k':>3s} {'thr':>3s} {'ms':>9s} {'ms/tok':>9s} {'GMAC/s':>8s} "
          f"{'GB/s':>6s} {'%bw':>5s} {'%peak':>6s}")
    for x in r["results"]:
        bw = f"{100 * x['share_of_bandwidth']:5.0f}"
        print(f"{x['kernel']:6s} {x['working_set']:4s} {x['k']:3d} {x['threads']:3d} {x['ms']:9.3f} "
              f"{x['ms_per_token']:9.3f} {x['gmacs']:8.1f} {x['gbps']:6.1f} {bw} {100 * x['share_of_peak']:6.0f}")
    print("%bw: of the read ceiling (DRAM rows: paired with read passes in the same rounds); "
          "%peak: of the dot-product issue peak")


def _print_decode(r: dict) -> None:
    print(f"{r['model']} ({r['format']}), {r['threads']} threads, context {r['context']}: "
          f"{r['tokens_per_s']:.1f} tokens/s ({r['ms_per_token']:.1f} ms/token)")
    print(f"{r['bytes_per_token'] / 1e6:.0f} MB read per token = {r['gbps']:.1f} GB/s; read ceiling "
          f"{r['read_gbps']:.1f} GB/s; share {100 * r['share_of_ceiling']:.0f}% (IQR {100 * r['share_of_ceiling_iqr']:.0f})")
    if "stages" in r:
        print(f"{'stage':10s} {'ms':>7s} {'part':>5s} {'MB':>6s} {'GB/s':>6s} {'%ceil':>6s}")
        for x in r["stages"]:
            mb = f"{x['bytes'] / 1e6:6.0f}" if x["bytes"] else f"{'':6s}"
            rate = f"{x['gbps']:6.1f} {100 * x['share_of_ceiling']:6.0f}" if x["bytes"] else ""
            print(f"{x['stage']:10s} {x['ms']:7.3f} {100 * x['part']:4.0f}% {mb} {rate}")


def _print_vk(r: dict) -> None:
    print(f"target {r['target']}, draft {r['draft']}, {r['format']}, {r['threads']} threads")
    for ctx in sorted({x["context"] for x in r["records"]}):
        vs = [x for x in r["records"] if x["context"] == ctx and x["kind"] == "v"]
        print(f"context {ctx}: " + " ".join(f"v({x['k']})={x['v']:.2f}" for x in vs))
        for x in r["records"]:
            if x["context"] == ctx and x["kind"] == "c":
                print(f"  c({x['format']}) = {x['c']:.3f} (IQR {x['c_iqr']:.3f})")
    print(f"o = {r['o']:.4f} of a target step (greedy); sampled: {r['overhead']['o_sampled']:.4f}")


def cmd_bench(args) -> int:
    from . import bench
    if args.what == "speculative":
        return cmd_bench_speculative(args)
    if args.what == "bandwidth":
        r = bench.bandwidth(threads=args.threads, mb=args.mb or 512, rounds=args.rounds)
        show = _print_bandwidth
    elif args.what == "decode":
        r = bench.decode_bench(args.model, args.scheme, args.threads[0] if args.threads else None,
                               (args.context or [256])[0], rounds=args.rounds, stages=args.stages)
        show = _print_decode
    elif args.what == "vk":
        ks = tuple(args.k) if args.k != [1, 2, 4, 8, 16] else tuple(range(1, 17))
        r = bench.vk_bench(args.model, args.draft, args.scheme, args.threads[0] if args.threads else None,
                           tuple(args.context or (128, 512, 2048)), ks, rounds=args.rounds, progress=not args.json)
        show = _print_vk
    else:
        r = bench.kernels_bench(ks=tuple(args.k), fmts=tuple(args.kernel), threads=args.threads[0] if args.threads else None,
                                quick=args.quick, path=args.path)
        show = _print_kernels
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        show(r)
    return 0


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
    from .bench import commit, machine
    from .engine import Engine
    from .kernels import Pool
    from .models.export import engine_file
    pool = Pool(args.threads[0] if args.threads else None)
    target = Engine(engine_file(args.model, args.scheme), pool=pool, max_context=4096)
    draft = _draft_engine(args, pool, 4096)
    gammas = args.gamma or [4]
    pol_name = args.policy or ("fixed" if args.gamma else "auto")
    chosen = speculative.settings(args.draft, pol_name, gammas)
    prompts = speculative.prompts_from(args.prompts, args.per_group)
    costs = policy.costs_for(target, draft)
    pol = None
    if pol_name == "auto":
        path = policy.calibration_path(target, draft)
        if args.calibrate or not path.exists():
            from .vocab import training_samples
            cal = policy.calibrate(target, draft, training_samples(target, args.model))
            policy.save_calibration(cal, target, draft)
        pol = policy.policy_for(target, draft, args.temperature, max_gamma=args.max_gamma)
    # the progress bar goes to stderr, so it shows with --json too
    res = speculative.run(target, {"draft": draft}, prompts, chosen, args.max_new_tokens, args.temperature,
                          args.seed, {"draft": costs}, {"draft": pol}, args.model, progress=True)
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
        return [int(t) for t in prompt.split()], None
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
    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    ids, tok = _prompt_ids(args.model, prompt, not args.raw)
    pool = Pool(args.threads)
    target = Engine(engine_file(args.model, args.scheme), pool=pool, max_context=args.max_context)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, on_token=_Stream(tok))
    if args.draft or args.lookup:
        draft = "lookup" if args.lookup else _draft_engine(args, pool, args.max_context)
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
    index = runner.run(args.notebooks or None, args.profile, profiles.parse_set(args.set), args.out)
    entries = json.loads((index.parent / "index.json").read_text())["entries"]
    print(index)
    return 1 if any(e["status"] != "ok" for e in entries if e["notebook"] in (args.notebooks or profiles.notebooks())) else 0


def _draft_flags(p) -> None:
    p.add_argument("--draft", help="a draft model for speculative decoding")
    p.add_argument("--draft-scheme", default="q4-q8out")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="the draft's output trimmed to N tokens (default: lab.vocab.DEFAULT_N; 0: stock)")
    p.add_argument("--draft-vocab-format", default="q4", choices=["q4", "q8"])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lab", description="Speculative decoding on a CPU: the lab's command.")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="this CPU, its kernel paths and the native build")
    info.add_argument("--json", action="store_true")
    info.set_defaults(fn=cmd_info)

    r = sub.add_parser("run", help="execute notebooks with papermill into HTML reports and an index")
    r.add_argument("notebooks", nargs="*", help="notebook names (default: all)")
    r.add_argument("--profile", default="quick", help="a profile in params/ (quick, default, qwen3) or a .yaml path")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a parameter")
    r.add_argument("--out", help="output folder (default: outputs/<profile>)")
    r.set_defaults(fn=cmd_run)

    m = sub.add_parser("models", help="the models the lab knows: list, fetch")
    m.add_argument("action", choices=["list", "fetch", "export", "compare", "ppl"],
                   help="compare: the reference against transformers; ppl: perplexity per format")
    m.add_argument("names", nargs="*", help="models to act on")
    m.add_argument("--window", type=int, default=256, help="ppl: tokens per window")
    m.add_argument("--windows", type=int, default=8, help="ppl: how many windows")
    m.add_argument("--scheme", default="q4-q8out", help="export: f32, q8, q4 or q4-q8out")
    m.add_argument("--draft-vocab", type=int, help="export: a draft trimmed to N output tokens (needs --for)")
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
    g.add_argument("--gamma", type=int, help="fixed guesses per round (1-16; 4 under --policy fixed)")
    g.add_argument("--threshold", type=float, default=0.0, help="draft stops when its top probability is below")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int)
    g.add_argument("--max-context", type=int, default=4096)
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="quick measurements, JSON out")
    b.add_argument("what", choices=["bandwidth", "kernels", "decode", "vk", "speculative"])
    b.add_argument("--model", default="qwen2.5-coder-1.5b", help="decode/vk/speculative: the target")
    b.add_argument("--draft", default="qwen2.5-coder-0.5b", help="vk/speculative: the draft ('lookup': none)")
    b.add_argument("--draft-vocab", type=int, default=None,
                   help="speculative: the draft's output trimmed to N tokens (default: lab.vocab.DEFAULT_N; 0: stock)")
    b.add_argument("--draft-vocab-format", default="q4", choices=["q4", "q8"])
    b.add_argument("--draft-scheme", default="q4-q8out")
    b.add_argument("--prompts", help="speculative: a Spec-Bench-format JSONL (default: the shipped dev set)")
    b.add_argument("--per-group", type=int, help="speculative: prompts per group (default: all)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--policy", choices=["fixed", "auto"], help="speculative: auto unless --gamma is given")
    b.add_argument("--gamma", type=_int_list, help="speculative: fixed guesses per round, e.g. 1,2,4")
    b.add_argument("--max-gamma", type=int, default=8, help="speculative: the automatic policy's longest round")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--calibrate", action="store_true", help="speculative: fit the policy's calibration again")
    b.add_argument("--scheme", default="q4-q8out", help="decode/vk: weights format")
    b.add_argument("--context", type=_int_list, help="decode: one context (256); vk: several (128,512,2048)")
    b.add_argument("--json", action="store_true", help="print machine-readable results")
    b.add_argument("--threads", type=_int_list, help="thread counts, e.g. 1,2 (kernels: the first)")
    b.add_argument("--mb", type=int, help="bandwidth buffer size in MB (default 512)")
    b.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    b.add_argument("--k", type=_int_list, default=[1, 2, 4, 8, 16], help="token counts (kernels)")
    b.add_argument("--kernel", type=lambda s: s.split(","), default=["q4", "q8"], help="q4,q8")
    b.add_argument("--path", help="force a kernel path: scalar, avx2, avxvnni, avx512vnni")
    b.add_argument("--quick", action="store_true", help="smaller matrices and fewer repeats")
    b.add_argument("--stages", action="store_true", help="decode: time each stage of the pass too")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except (LabError, ValueError, TypeError) as e:
        print(f"lab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
