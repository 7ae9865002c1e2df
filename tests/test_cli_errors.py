"""`lab` refuses bad input before any work starts: one line on stderr (`lab: error: ...`), exit
status 2, no traceback (LAB_DEBUG=1 shows it instead), and nothing half-written left behind."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import cli, profiles

TINY = ["--model", "tiny-qwen2"]


def _fails(capsys, argv: list[str], phrase: str) -> str:
    """Runs `lab argv`; asserts exit status 2 and one line naming the problem, and returns it."""
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (argv, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lab: error: "), err
    assert phrase in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("argv, phrase", [
    (["generate", *TINY, "--temperature", "nan", "1 2 3"], "--temperature: must be a number >= 0, got 'nan'"),
    (["generate", *TINY, "--temperature", "inf", "1 2 3"], "--temperature: must be a number >= 0"),
    (["generate", *TINY, "--temperature", "-0.5", "1 2 3"], "--temperature: must be a number >= 0"),
    (["generate", *TINY, "--top-p", "0", "1 2 3"], "--top-p: must be a number > 0 and <= 1"),
    (["generate", *TINY, "--top-p", "1.5", "1 2 3"], "--top-p: must be a number > 0 and <= 1"),
    (["generate", *TINY, "--top-k", "-1", "1 2 3"], "--top-k: must be an integer >= 0"),
    (["generate", *TINY, "--max-new-tokens", "0", "1 2 3"], "--max-new-tokens: must be an integer >= 1"),
    (["generate", *TINY, "--max-new-tokens", "-4", "1 2 3"], "--max-new-tokens: must be an integer >= 1"),
    (["generate", *TINY, "--threads", "0", "1 2 3"], "--threads: must be an integer from 1 to"),
    (["generate", *TINY, "--seed", "-1", "1 2 3"], "--seed: must be an integer from 0"),
    (["bench", "bandwidth", "--threads", "1,0"], "--threads: must be an integer from 1 to"),
    (["bench", "kernels", "--threads", "0"], "--threads: must be an integer from 1 to"),
    (["bench", "bandwidth", "--mb", "0"], "--mb: must be an integer >= 1"),
    (["bench", "bandwidth", "--mb", "-1"], "--mb: must be an integer >= 1"),
    (["bench", "decode", *TINY, "--rounds", "0"], "--rounds: must be an integer >= 1"),
    (["bench", "decode", *TINY, "--context", "0"], "--context: must be an integer >= 1"),
    (["bench", "decode", *TINY, "--k", "0"], "--k: must be an integer >= 1"),
    (["bench", "decode", *TINY, "--k", "99"], "--k 99: a kernel call takes 1 to"),
    (["bench", "decode", *TINY, "--context", "256,512"], "--context: must be an integer >= 1, got '256,512'"),
    (["bench", "decode", *TINY, "--threads", "1,2"], "--threads: must be an integer from 1 to"),
    (["bench", "vk", *TINY, "--context", "64,0"], "--context: must be an integer >= 1, got '0'"),
    (["bench", "kernels", "--k", "1,0"], "--k: must be an integer >= 1, got '0'"),
    (["bench", "speculative", "--gamma", "0,2"], "--gamma: must be an integer from 1 to"),
    (["bench", "kernels", "--path", "sse9"], "--path: 'sse9' is not a kernel path"),
    (["models", "ppl", "x", "--windows", "0"], "--windows: must be an integer >= 1"),
])
def test_flag_values_are_checked_as_they_are_parsed(capsys, argv, phrase):
    _fails(capsys, argv, phrase)


def test_gamma_and_k_are_bounded_by_the_engines_max_k(capsys):
    from lab import native
    top = native.consts().max_k
    msg = _fails(capsys, ["generate", *TINY, "--lookup", "--gamma", str(top + 1), "1 2 3"], "--gamma")
    assert f"from 1 to {top}" in msg
    msg = _fails(capsys, ["bench", "kernels", "--k", f"1,{top + 1}"], f"--k {top + 1}")
    assert f"1 to {top} tokens" in msg
    msg = _fails(capsys, ["bench", "vk", *TINY, "--draft", "tiny-qwen2", "--k", f"1,{top + 1}"], f"--k {top + 1}")
    assert f"1 to {top} tokens" in msg


@pytest.mark.parametrize("argv, phrase", [
    (["generate", *TINY, "--gamma", "3", "1 2 3"], "--gamma only applies to speculative decoding: add --draft"),
    (["generate", *TINY, "--policy", "fixed", "1 2 3"], "--policy only applies to speculative decoding"),
    (["generate", *TINY, "--draft-vocab", "8", "1 2 3"], "--draft-vocab trims a draft model"),
    (["generate", *TINY, "--lookup", "--policy", "auto", "--gamma", "3", "1 2 3"],
     "--gamma only applies to --policy fixed"),
    (["bench", "speculative", "--policy", "auto", "--gamma", "2"], "--gamma only applies to --policy fixed"),
    (["generate", *TINY, "--draft", "tiny-qwen2", "--lookup", "1 2 3"], "--draft and --lookup exclude each other"),
    (["generate", *TINY, "--scheme", "q3", "1 2 3"], "--scheme q3: not a weights format"),
    (["generate", *TINY, "--max-context", "200000000", "1 2 3"],
     "--max-context 200000000 is longer than tiny-qwen2 supports: at most 4096 positions"),
    (["generate", *TINY, "--max-context", "8", "--max-new-tokens", "10", "1 2 3"],
     "need a context of 13, more than --max-context 8"),
    (["generate", *TINY, "hello world"], "tiny-qwen2 has no tokenizer: give the prompt as token ids"),
    (["generate", *TINY, "--draft", "tiny-llama", "1 2 3"],
     "the draft tiny-llama's vocabulary (320 tokens) differs from the target tiny-qwen2's (380)"),
    (["bench", "vk", *TINY, "--draft", "tiny-llama"], "vocabulary (320 tokens) differs from the target"),
    (["bench", "speculative", *TINY, "--draft", "tiny-llama"], "vocabulary (320 tokens) differs from the target"),
    (["bench", "vk", *TINY, "--draft", "tiny-qwen2", "--context", "64,5000"],
     "--context 5000 is longer than tiny-qwen2 supports"),
    (["bench", "speculative", *TINY, "--draft", "tiny-qwen2", "--prompts", "/nonexistent.jsonl"], "no such file"),
    (["bench", "kernels", "--kernel", "q4,q5"], "--kernel q5: no such kernel; the kernels are q4, q8"),
    (["bench", "vk", *TINY, "--draft", "tiny-qwen2", "--k", "2,4"], "--k 2,4: v(k) is measured against the one-token"),
    (["bench", "decode", *TINY, "--scheme", "q3"], "--scheme q3: not a weights format"),
    (["bench", "speculative", *TINY, "--draft-scheme", "q3"], "--draft-scheme q3: not a weights format"),
    (["models", "export"], "lab models export needs one or more model names; the lab knows: qwen2.5-coder-1.5b"),
    (["models", "fetch"], "lab models fetch needs one or more model names"),
    (["models", "export", "no-such-model"], "unknown model 'no-such-model'"),
    (["models", "export", "tiny-qwen2", "--scheme", "q5"], "--scheme q5: not a weights format"),
])
def test_flags_that_need_each_other_or_a_model_are_checked_before_work(capsys, argv, phrase):
    _fails(capsys, argv, phrase)


@pytest.mark.parametrize("setting, phrase", [
    ("contexts=[256", "--set contexts: '[256' is not a valid YAML value"),
    ("threads=abc", "threads must be int, got str 'abc'"),
    ("threads=0", "threads must be from 1 to"),
    ("gammas=[0,99]", "gammas[0] must be from 1 to"),
    ("gammas=[1,99]", "gammas[1] must be from 1 to"),
    ("per_group=-3", "per_group must be >= 1, got -3"),
    ("per_group=null", "per_group must be int, got null"),
    ("nonsense", "write key=value"),
])
def test_run_checks_set_values_before_any_notebook(capsys, tmp_path, setting, phrase):
    out = tmp_path / "out"
    _fails(capsys, ["run", "gamma", "--set", setting, "--out", str(out)], phrase)
    assert not out.exists()


@pytest.mark.parametrize("text, phrase", [
    ("notebooks:\n  - gamma\n", "notebooks must be a mapping of notebook name: parameters, got list"),
    ("shared: 3\n", "shared must be a mapping of parameter: value, got int 3"),
    ("42\n", "the profile must be a mapping of description, shared and notebooks, got int 42"),
    ("notebooks:\n  gamma: 5\n", "notebooks.gamma must be a mapping"),
    ("shared:\n  threads: 0\n", "shared: threads must be from 1 to"),
    ("notebooks:\n  gamma: {held: 1}\n", "notebooks.gamma.held is not a parameter of gamma"),
    ("notebooks:\n  gamma: {gammas: [1, 2.5]}\n", "gammas[1] must be int, got float 2.5"),
    ("notebooks:\n  distill: {held_out: .nan}\n", "held_out must be from 0 to 1, got nan"),
    ("notebooks:\n  policy: {sampled_temperatures: [0.7, 0]}\n",
     "sampled_temperatures[1] must be > 0 (0 is the greedy run), got 0"),
    ("shared: [1\n", "is not valid YAML"),
])
def test_run_checks_the_profile_file(capsys, tmp_path, text, phrase):
    profile = tmp_path / "bad.yaml"
    profile.write_text(text)
    nb = next((n for n in ("distill", "policy") if n in text), "gamma")
    msg = _fails(capsys, ["run", nb, "--profile", str(profile), "--out", str(tmp_path / "out")], phrase)
    assert str(profile) in msg
    assert not (tmp_path / "out").exists()


def test_any_other_exception_is_one_line_with_its_type(capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("first line\nsecond line")
    monkeypatch.setattr(cli, "cmd_info", boom)
    assert _fails(capsys, ["info"], "RuntimeError") == "lab: error: RuntimeError: first line; second line"


def test_keyboard_interrupt_exits_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_info", interrupted)
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err.strip() == "lab: interrupted"


def test_lab_debug_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("LAB_DEBUG", "1")
    assert cli.main(["models", "export"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "needs one or more model names" in err


def test_the_command_itself_exits_2_with_one_line():
    """The installed entry point, as a shell sees it: status 2, one line, no traceback."""
    env = {k: v for k, v in os.environ.items() if k != "LAB_DEBUG"}
    script = Path(sys.executable).with_name("lab")
    lab = [str(script)] if script.exists() else [sys.executable, "-m", "lab.cli"]
    p = subprocess.run([*lab, "generate", "--temperature", "nan", "1 2 3"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == ["lab: error: argument --temperature: must be a number >= 0, got 'nan' "
                                     "(see lab generate --help)"]


def test_valid_generation_still_runs(capsys):
    assert cli.main(["generate", *TINY, "--threads", "1", "--max-new-tokens", "3", "1 2 3"]) == 0
    assert len(capsys.readouterr().out.split()) == 3


def test_a_bad_prompts_file_fails_before_the_models_load(capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa"}\n')
    monkeypatch.setattr("lab.engine.Engine", None)      # loading a model would fail with a TypeError
    _fails(capsys, ["bench", "speculative", *TINY, "--draft", "lookup", "--prompts", str(bad), "--gamma", "2"],
           "bad.jsonl:1: a prompt needs question_id, category and turns")


# ----------------------------------------------------------------------------
# lab bench: one parser per bench, each with only its own flags
# ----------------------------------------------------------------------------

BENCHES = ["bandwidth", "kernels", "decode", "vk", "speculative", "baseline"]


def test_bench_alone_names_the_benches_in_one_line(capsys):
    msg = _fails(capsys, ["bench"], "the following arguments are required")
    assert "{" + ",".join(BENCHES) + "}" in msg and "(see lab bench --help)" in msg


@pytest.mark.parametrize("argv, flag", [
    (["bench", "kernels", "--rounds", "2"], "--rounds"),          # kernels sets its own repeats
    (["bench", "decode", "--mb", "64"], "--mb"),                   # bandwidth's buffer
    (["bench", "bandwidth", "--model", "tiny-qwen2"], "--model"),
    (["bench", "decode", "--draft-scheme", "q8"], "--draft-scheme"),
    (["bench", "vk", "--gamma", "2"], "--gamma"),
    (["bench", "speculative", "--context", "256"], "--context"),
])
def test_each_bench_refuses_the_flags_of_the_others(capsys, argv, flag):
    _fails(capsys, argv, f"unrecognized arguments: {flag}")


@pytest.mark.parametrize("argv", [[], ["bench"], *(["bench", b] for b in BENCHES)], ids=lambda a: " ".join(a) or "lab")
def test_help_builds_nothing(capsys, monkeypatch, argv):
    """Bounds that come from the engine are read only when their flag is given, so --help needs no compiler."""
    from lab import native

    def no_build(*a, **kw):
        raise AssertionError("--help touched the native library")
    for name in ("build", "lib", "consts"):
        monkeypatch.setattr(native, name, no_build)
    assert cli.main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join(['lab', *argv])} ")


@pytest.mark.parametrize("bench", ["kernels", "vk"])
def test_an_explicit_k_list_is_kept_as_given(bench):
    args = cli.parser().parse_args(["bench", bench, "--k", "1,2,4,8,16"])
    assert args.k == [1, 2, 4, 8, 16]
    assert cli.parser().parse_args(["bench", bench, "--k", "16,1,3"]).k == [16, 1, 3]


def _vk_ks(monkeypatch, capsys, extra: list[str]) -> tuple:
    """The ks lab bench vk hands to lab.costs.vk_bench (a stand-in: nothing is measured)."""
    seen = {}

    def fake_vk_bench(*a, **kw):
        seen["ks"] = a[3]
        return {}
    monkeypatch.setattr("lab.costs.vk_bench", fake_vk_bench)
    assert cli.main(["bench", "vk", *TINY, "--draft", "tiny-qwen2", "--json", *extra]) == 0
    capsys.readouterr()
    return seen["ks"]


def test_vk_measures_the_k_given_and_else_1_to_max_k(monkeypatch, capsys):
    from lab import profiles
    assert _vk_ks(monkeypatch, capsys, ["--k", "1,2,4,8,16"]) == (1, 2, 4, 8, 16)
    assert _vk_ks(monkeypatch, capsys, []) == tuple(range(1, profiles.max_k() + 1))


def test_each_bench_runs_its_own_command():
    p = cli.parser()
    for bench in BENCHES:
        assert p.parse_args(["bench", bench]).fn is getattr(cli, f"cmd_bench_{bench}")
    args = p.parse_args(["bench", "decode", "--context", "512", "--threads", "1"])
    assert (args.context, args.threads) == (512, 1)
    args = p.parse_args(["bench", "bandwidth", "--threads", "1,1"])      # a list, on a one-CPU machine too
    assert args.threads == [1, 1] and args.mb == 512


def test_baseline_refuses_a_dtype_transformers_is_not_run_in(capsys):
    msg = _fails(capsys, ["bench", "baseline", "--model", "tiny-qwen2", "--draft", "tiny-qwen2-draft",
                          "--hf-dtype", "fp16"], "--hf-dtype fp16")
    assert "fp32 or bf16" in msg


def test_an_install_without_the_checkout_says_so(monkeypatch, tmp_path):
    """A plain `pip install .` leaves kernels_cpp/ and notebooks/ behind: one line saying why."""
    from lab import native
    monkeypatch.setattr(native, "SOURCE_DIR", tmp_path / "kernels_cpp")
    with pytest.raises(native.NativeBuildError, match="runs from a checkout"):
        native.build_key("c++")
    monkeypatch.setattr(profiles, "NOTEBOOKS", tmp_path / "notebooks")
    with pytest.raises(profiles.ProfileError, match="runs from a checkout"):
        profiles.notebooks()


def test_vk_says_when_the_bus_changed_state_during_a_context(capsys):
    def rec(ctx, before, after):
        return {"kind": "v", "context": ctx, "k": 1, "v": 1.0, "read_gbps_before": before, "read_gbps_after": after}
    cli._print_vk({"target": "t", "draft": None, "format": "q4", "attention": "f32", "threads": 2,
                   "records": [rec(256, 32.0, 34.0), rec(2048, 28.0, 51.0)], "o": 0.003,
                   "overhead": {"o_sampled": 0.01}})
    steady, flipped = capsys.readouterr().out.splitlines()[1:3]
    assert "changed state" not in steady and "changed state" in flipped


def test_vk_shows_each_ratios_spread(capsys):
    recs = [{"kind": "v", "context": 256, "k": k, "v": v, "v_iqr": iqr, "read_gbps_before": 30.0,
             "read_gbps_after": 30.0} for k, v, iqr in ((1, 1.0, 0.0), (2, 1.04, 0.031))]
    cli._print_vk({"target": "t", "draft": None, "format": "q4", "attention": "f32", "threads": 2,
                   "records": recs, "o": 0.003, "overhead": {"o_sampled": 0.01}})
    line = capsys.readouterr().out.splitlines()[1]
    assert line.endswith("v(1)=1.00 v(2)=1.04 (IQR 0.03)")
