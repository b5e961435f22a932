"""Search spaces: the shipped TOML files, the loader's refusals, runnability, resolution."""

import functools
from importlib import resources
from pathlib import Path

import pytest

from conftest import refusal_of, replaced_once, write_toml
from cptune import STRATEGIES, AttentionShape, CPConfig, CPTuneError, Workload, analytic_cost
from cptune.space import (
    DEMO_SPACE,
    MeasureSettings,
    SearchSpace,
    SpaceError,
    builtin_spaces,
    check_runnable,
    load_space,
    resolve_space,
)

SHIPPED = ("demo", "flux1-dev", "flux1-dev-1008", "flux1-dev-joint", "llama3-8b-train-packed",
           "llm-prefill-gqa", "mistral-7b-window-sinks", "video-dit")

BASE = """\
name = "t"
description = "test space"

[model]
heads = 8
head_dim = 16

[sweep]
seq_lens = [64, 128]
strategies = ["ring", "ulysses"]

[measure]
warmup = 1
repeats = 3
"""


write = functools.partial(write_toml, name="space.toml")
edited = functools.partial(replaced_once, BASE)
refusal = functools.partial(refusal_of, load_space, SpaceError)


# --------------------------------------------------------------------------- shipped spaces


def test_every_shipped_space_is_a_package_resource():
    listed = {entry.name for entry in resources.files("cptune.search_spaces").iterdir()}
    assert {f"{name}.toml" for name in SHIPPED} <= listed
    assert tuple(builtin_spaces()) == SHIPPED  # sorted, keyed by stem
    assert DEMO_SPACE in builtin_spaces()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_space_loads_and_builds_its_workloads(name):
    path = resolve_space(name)
    space = load_space(path)
    assert space.name == name
    assert space.description
    assert space.source == path
    workloads = space.workloads()
    assert [w.seq_len for w in workloads] == list(space.seq_lens)
    for w in workloads:
        assert w.shape == space.shape
    check_runnable(space, 8, str(path))  # every length runs somewhere on 8 ranks


def test_flux_space_matches_its_derivation():
    space = load_space(resolve_space("flux1-dev"))
    text_tokens = 512  # T5 max_sequence_length
    image_tokens = [(side // 16) ** 2 for side in (1024, 2048)]  # VAE /8, then 2x2 patches
    assert space.seq_lens == tuple(text_tokens + n for n in image_tokens) == (4608, 16896)
    assert (space.shape.heads, space.shape.kv_heads, space.shape.head_dim) == (24, 24, 3072 // 24)
    assert (space.shape.dtype, space.shape.causal, space.shape.batch) == ("bf16", False, 1)


def test_video_space_matches_its_derivation():
    space = load_space(resolve_space("video-dit"))
    frames = (81 - 1) // 4 + 1  # Wan-VAE stride 4 in time, first frame kept
    tokens = [frames * (h // 8 // 2) * (w // 8 // 2) for w, h in ((832, 480), (1280, 720))]
    assert space.seq_lens == tuple(tokens) == (32760, 75600)
    assert (space.shape.heads, space.shape.kv_heads, space.shape.head_dim) == (40, 40, 5120 // 40)
    assert (space.shape.dtype, space.shape.causal) == ("bf16", False)


def test_llm_space_is_causal_gqa_up_to_the_context_length():
    space = load_space(resolve_space("llm-prefill-gqa"))
    assert (space.shape.heads, space.shape.kv_heads, space.shape.head_dim) == (32, 8, 4096 // 32)
    assert space.shape.causal is True
    assert space.seq_lens[0] == 8192 and max(space.seq_lens) == 131072
    assert list(space.seq_lens) == sorted(set(space.seq_lens))


def test_masked_spaces_match_their_derivations():
    packed = load_space(resolve_space("llama3-8b-train-packed"))
    lengths = packed.workloads()[0].document_lengths
    assert packed.seq_lens == (131072,) and sum(lengths) == 131072 and len(lengths) > 1
    assert min(lengths) >= 2048 and max(lengths) <= 32768
    assert (packed.shape.heads, packed.shape.kv_heads, packed.shape.head_dim) == (32, 8, 128)
    assert packed.shape.causal and packed.shape.mode == "train"
    windowed = load_space(resolve_space("mistral-7b-window-sinks"))
    assert (windowed.shape.window, windowed.shape.sinks, windowed.shape.causal) == ((4096, 0), 4, True)
    joint = load_space(resolve_space("flux1-dev-joint"))
    assert joint.seq_lens == (512 + (1024 // 16) ** 2,) and joint.shape.text == 512
    odd = load_space(resolve_space("flux1-dev-1008"))
    assert odd.seq_lens == (512 + (1008 // 16) ** 2,) == (4481,) and odd.shape.text == 512
    assert not any(4481 % n == 0 for n in range(2, 4481))  # no rank count divides it
    assert (joint.shape.heads, joint.shape.head_dim) == (odd.shape.heads, odd.shape.head_dim) == (24, 128)


def test_demo_space_is_small_enough_for_a_cpu():
    space = load_space(resolve_space(DEMO_SPACE))
    assert space.ranks is None  # "auto": follows the host's cores
    assert space.strategies == STRATEGIES
    iterations = space.measure.warmup + space.measure.repeats
    flops = sum(analytic_cost(w, CPConfig("ring", 1)).flops for w in space.workloads())
    # One configuration's whole sweep: under 1 TFLOP, i.e. ~10 s at the ~120 GFLOP/s two
    # cores reach (benchmarks/results), a couple of minutes even at 10 GFLOP/s.
    assert flops * iterations < 1e12, flops * iterations
    check_runnable(space, 2, "demo")
    check_runnable(space, 1, "demo")


# --------------------------------------------------------------------------- loading


def test_minimal_space_gets_the_documented_defaults(tmp_path):
    path = write(tmp_path, 'name = "m"\n[model]\nheads = 6\nhead_dim = 32\n[sweep]\nseq_lens = [100]\n')
    space = load_space(path)
    assert space == SearchSpace(
        name="m", description="", source=path, shape=AttentionShape(6, 6, 32, 1, "bf16", False),
        seq_lens=(100,), ranks=None, strategies=STRATEGIES,
        trials=None, measure=MeasureSettings(warmup=2, repeats=10, timeout=None),
    )


def test_full_space_reads_every_key(tmp_path):
    text = """\
name = "full"
description = "all keys"
[model]
heads = 32
kv_heads = 8
head_dim = 128
batch = 2
dtype = "fp16"
causal = true
[sweep]
seq_lens = [4096, 1024]
ranks = [8, 2]
strategies = ["ulysses", "ring"]
trials = 12
[measure]
warmup = 0
repeats = 1
timeout = 600
rounds = 3
race_rounds = 0
confirm_rounds = 5
"""
    space = load_space(str(write(tmp_path, text)))
    assert space.shape == AttentionShape(32, 8, 128, 2, "fp16", True)
    assert space.seq_lens == (4096, 1024)  # order kept
    assert space.ranks == (8, 2)
    assert space.strategies == ("ulysses", "ring")  # order kept
    assert space.trials == 12
    assert space.measure == MeasureSettings(warmup=0, repeats=1, timeout=600.0, rounds=3, race_rounds=0,
                                            confirm_rounds=5)
    assert isinstance(space.measure.timeout, float)
    assert space.workloads()[1] == Workload(1024, 32, 128, kv_heads=8, batch=2, dtype="fp16", causal=True)


BAD = [
    # unknown keys, at the top and inside tables, with the allowed ones listed
    ('name = "t"', 'name = "t"\nnmae = "u"', "nmae",
     ["unknown key", "did you mean 'name'", "name, description, model, sweep, measure"]),
    ("heads = 8", "heads = 8\nhaeds = 8", "model.haeds",
     ["unknown key", "did you mean 'heads'", "heads, kv_heads, head_dim, batch, dtype, causal"]),
    ("repeats = 3", "repeat = 3", "measure.repeat", ["unknown key", "did you mean 'repeats'"]),
    ("[measure]", "[measure]\nflops = 1", "measure.flops",
     ["unknown key", "warmup, repeats, timeout, rounds, race_rounds"]),
    ("[sweep]", "[sweep]\nstrategy = [\"ring\"]", "sweep.strategy",
     ["unknown key", "did you mean 'strategies'"]),
    # wrong types: expected and given both named
    ("heads = 8", 'heads = "8"', "model.heads", ["expected a positive integer", 'got a string ("8")']),
    ("head_dim = 16", "head_dim = 16.0", "model.head_dim", ["expected a positive integer", "got a float"]),
    ("heads = 8", "heads = 8\nbatch = true", "model.batch", ["expected a positive integer", "got a boolean"]),
    ("heads = 8", "heads = 8\ncausal = 1", "model.causal", ["expected a boolean", "got an integer"]),
    ('name = "t"', "name = 5", "name", ["expected a string", "got an integer"]),
    ("[sweep]\nseq_lens = [64, 128]", "[sweep]\nseq_lens = 64", "sweep.seq_lens",
     ["expected an array", "got an integer"]),
    ("seq_lens = [64, 128]", 'seq_lens = [64, "128"]', "sweep.seq_lens[1]",
     ["expected a positive integer", "got a string"]),
    ("seq_lens = [64, 128]", "seq_lens = [64, true]", "sweep.seq_lens[1]", ["got a boolean"]),
    ("repeats = 3", 'repeats = 3\ntimeout = "10"', "measure.timeout",
     ["expected a positive number of seconds", "got a string"]),
    # out-of-range values
    ("heads = 8", "heads = 0", "model.heads", ["out of range", "got 0"]),
    ("warmup = 1", "warmup = -1", "measure.warmup", ["out of range", "integer >= 0"]),
    ("repeats = 3", "repeats = 0", "measure.repeats", ["out of range", "got 0"]),
    ("repeats = 3", "repeats = 3\nrounds = 0", "measure.rounds", ["out of range", "got 0"]),
    ("repeats = 3", "repeats = 3\nrace_rounds = -1", "measure.race_rounds", ["out of range", "integer >= 0"]),
    ("repeats = 3", "repeats = 3\nconfirm_rounds = -1", "measure.confirm_rounds",
     ["out of range", "integer >= 0"]),
    ("repeats = 3", "repeats = 3\ntimeout = 0", "measure.timeout", ["out of range", "positive"]),
    ("seq_lens = [64, 128]", "seq_lens = [64, 128]\ntrials = 0", "sweep.trials", ["out of range"]),
    ("seq_lens = [64, 128]", "seq_lens = [64, -128]", "sweep.seq_lens[1]", ["out of range", "-128"]),
    # counts past what a search can use: hours of runs that settle nothing more
    ("repeats = 3", "repeats = 100000000", "measure.repeats",
     ["out of range", "at most 10,000", "100,000,000"]),
    ("warmup = 1", "warmup = 5000", "measure.warmup", ["out of range", "at most 1,000"]),
    ("repeats = 3", "repeats = 3\nrace_rounds = 99999", "measure.race_rounds", ["at most 1,000"]),
    ("seq_lens = [64, 128]", f"seq_lens = [{', '.join(str(64 * i) for i in range(1, 258))}]",
     "sweep.seq_lens", ["257 lengths", "more than the 256", "split it"]),
    ('name = "t"', 'name = "  "', "name", ["must not be empty"]),
    # characters a terminal prints as something else: a name must read as it prints
    ('name = "t"', 'name = "t\\u202Eevil"', "name", ["invisible character U+202E", "remove it"]),
    ('name = "t"', 'name = "t\\u0000"', "name", ["invisible character U+0000"]),
    ('description = "test space"', 'description = "a\\u2066b"', "description", ["U+2066"]),
    # lists: empty, duplicated, unknown names
    ("seq_lens = [64, 128]", "seq_lens = []", "sweep.seq_lens", ["must not be empty"]),
    ("seq_lens = [64, 128]", "seq_lens = [64, 128, 64]", "sweep.seq_lens[2]",
     ["duplicate value 64", "sweep.seq_lens[0]"]),
    ('strategies = ["ring", "ulysses"]', 'strategies = ["ring", "rign"]', "sweep.strategies[1]",
     ["unknown strategy", "did you mean 'ring'", "allgather_kv, ring, ulysses"]),
    ('strategies = ["ring", "ulysses"]', "strategies = []", "sweep.strategies", ["must not be empty"]),
    ('strategies = ["ring", "ulysses"]', 'strategies = ["ring", "ring"]', "sweep.strategies[1]",
     ["duplicate"]),
    ("seq_lens = [64, 128]", 'seq_lens = [64, 128]\nranks = "all"', "sweep.ranks",
     ['expected "auto" or an array of positive integers', 'got a string ("all")']),
    ("seq_lens = [64, 128]", "seq_lens = [64, 128]\nranks = [2, 0]", "sweep.ranks[1]", ["out of range"]),
    ("seq_lens = [64, 128]", "seq_lens = [64, 128]\nranks = []", "sweep.ranks", ["must not be empty"]),
    ("heads = 8", 'heads = 8\ndtype = "fp8"', "model.dtype", ["unknown dtype", "bf16, fp16, fp32"]),
    # missing required keys and tables, with an example to copy
    ("head_dim = 16", "", "model.head_dim", ["missing required key", "head_dim = 128"]),
    ('name = "t"', "", "name", ["missing required key"]),
    ('[sweep]\nseq_lens = [64, 128]\nstrategies = ["ring", "ulysses"]\n', "", "sweep",
     ["missing required table", "[sweep]"]),
    # a model Workload rejects: its own words, against the key at fault
    ("heads = 8", "heads = 8\nkv_heads = 3", "model.kv_heads",
     ["8 query heads cannot share 3 KV heads", "heads must be a multiple of kv_heads"]),
    # masks: each part against its own key, what depends on the length at that length
    ("heads = 8", "heads = 8\nwindow = [1, 2, 3]", "model.window", ["expected [left, right]", "got 3"]),
    ("heads = 8", "heads = 8\nwindow = -1", "model.window", ["out of range"]),
    ("heads = 8", "heads = 8\nwindow = 100", "model.window",
     ["reaches across the whole 64-token", "sweep.seq_lens[0] = 64"]),
    ("heads = 8", "heads = 8\ncausal = true\nwindow = [8, 2]", "model.window", ["right to 0"]),
    ("heads = 8", "heads = 8\nsinks = 2", "model.sinks", ["give a window"]),
    ("heads = 8", "heads = 8\ndocuments = [0, 64]", "model.documents[0]", ["out of range"]),
    ("heads = 8", "heads = 8\ndocuments = []", "model.documents", ["packs no document"]),
    ("heads = 8", 'heads = 8\ndocuments = "docs.txt"', "model.documents", ['"@FILE"']),
    ("heads = 8", 'heads = 8\ndocuments = "@absent.txt"', "model.documents", ["cannot read it"]),
    ("heads = 8", "heads = 8\ndocuments = [32, 32]", "model.documents",
     ["sum to 64, not the sequence's 128", "sweep.seq_lens[1] = 128"]),
    ("heads = 8", "heads = 8\ntext = 64", "model.text", ["leave none of the 64-token"]),
    ("heads = 8", "heads = 8\ntext = 8\ncausal = true", "model.text", ["full over both"]),
]


@pytest.mark.parametrize("old, new, key, fragments", BAD, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD)])
def test_bad_space_is_refused_naming_file_key_and_problem(tmp_path, old, new, key, fragments):
    path = write(tmp_path, edited(old, new))
    message = refusal(path)
    assert message.startswith(f"{path}: {key}: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_space_mask_keys_are_read(tmp_path):
    (tmp_path / "docs.txt").write_text("# lengths\n16\n48\n\n")
    text = edited("heads = 8", 'heads = 8\ncausal = true\nwindow = 8\nsinks = 2\ndocuments = "@docs.txt"')
    space = load_space(write(tmp_path, text.replace("[64, 128]", "[64]")))
    assert space.shape == AttentionShape(8, 8, 16, 1, "bf16", True, window=(8, 0), sinks=2,
                                         documents=(16, 48))
    every = load_space(write(tmp_path, edited("heads = 8", "heads = 8\ndocuments = 32\nwindow = [4, 4]")))
    assert [w.document_lengths for w in every.workloads()] == [(32, 32), (32, 32, 32, 32)]
    assert every.shape.window == (4, 4)
    joint = load_space(write(tmp_path, edited("heads = 8", "heads = 8\ntext = 16")))
    assert joint.shape.text == 16 and joint.shape.describe_mask() == "joint, 16 text tokens"


def test_documents_file_is_read_bounded_and_regular_only(tmp_path):
    (tmp_path / "docs.json").write_text("[16, 48]")
    (tmp_path / "folder").mkdir()
    (tmp_path / "bad.txt").write_text("16\nsixteen\n")
    text = edited("heads = 8", 'heads = 8\ndocuments = "@docs.json"').replace("[64, 128]", "[64]")
    assert load_space(write(tmp_path, text)).shape.documents.lengths == (16, 48)
    assert "is a directory" in refusal(write(tmp_path, text.replace("docs.json", "folder")))
    assert "line 2 holds 'sixteen'" in refusal(write(tmp_path, text.replace("docs.json", "bad.txt")))


def test_non_table_section_is_refused(tmp_path):
    path = write(tmp_path, 'name = "t"\nmodel = 3\n[sweep]\nseq_lens = [64]\n')
    message = refusal(path)
    assert message.startswith(f"{path}: model: expected a table"), message
    assert "got an integer (3)" in message


def test_workload_rejection_reuses_workload_text(tmp_path):
    with pytest.raises(ValueError) as direct:
        Workload(64, 8, 16, kv_heads=3)
    reason = str(direct.value).removeprefix("kv_heads: ")
    message = refusal(write(tmp_path, edited("heads = 8", "heads = 8\nkv_heads = 3")))
    assert message.endswith(f"model.kv_heads: {reason}"), message


def test_invalid_toml_names_line_and_column(tmp_path):
    path = write(tmp_path, 'name = "t"\n[model]\nheads = \nhead_dim = 16\n')
    message = refusal(path)
    assert message.startswith(f"{path}: line 3, column "), message
    assert "invalid TOML" in message


def test_missing_file_is_refused_with_the_builtin_names(tmp_path):
    path = tmp_path / "nope.toml"
    message = refusal(path)
    assert message.startswith(f"{path}: (file): no such file"), message
    assert all(name in message for name in SHIPPED)


def test_unreadable_file_is_refused(tmp_path):
    message = refusal(tmp_path)  # a directory, not a file
    assert message == f"{tmp_path}: (file): is a directory, not a regular file; name a file", message


def test_space_error_is_a_cptune_error_and_a_value_error(tmp_path):
    with pytest.raises(SpaceError) as raised:
        load_space(tmp_path / "nope.toml")
    assert isinstance(raised.value, CPTuneError) and isinstance(raised.value, ValueError)
    assert raised.value.key == "(file)"
    assert raised.value.file == str(tmp_path / "nope.toml")


def test_measure_settings_refuse_bad_values_in_code():
    for bad in (dict(warmup=-1), dict(repeats=0), dict(repeats=True), dict(timeout=0), dict(timeout="5"),
                dict(rounds=0), dict(race_rounds=-1), dict(rounds=2.0), dict(repeats=10**8),
                dict(warmup=1001), dict(confirm_rounds=1001)):
        with pytest.raises(ValueError):
            MeasureSettings(**bad)


# --------------------------------------------------------------------------- runnable, ranks


def test_check_runnable_refuses_a_space_where_nothing_runs(tmp_path):
    text = (
        'name = "x"\n[model]\nheads = 3\nhead_dim = 16\n'
        '[sweep]\nseq_lens = [64]\nranks = [4]\nstrategies = ["ulysses"]\n'
    )
    path = write(tmp_path, text)
    space = load_space(path)  # loads: each field is fine on its own
    with pytest.raises(SpaceError) as raised:
        check_runnable(space, 8, str(path))
    message = str(raised.value)
    assert message.startswith(f"{path}: sweep.seq_lens[0]: seq_len 64 has no feasible configuration")
    # 3 heads on a head group of 4: padding them would leave a rank without a real head
    assert "On 4 ranks" in message and "a head group of 4 is larger than the 3 heads" in message


def test_check_runnable_names_the_failing_length_and_the_largest_rank_count(tmp_path):
    text = (
        'name = "x"\n[model]\nheads = 8\nhead_dim = 16\n'
        '[sweep]\nseq_lens = [64, 3]\nranks = [4, 8]\nstrategies = ["ring"]\n'
    )
    space = load_space(write(tmp_path, text))
    with pytest.raises(SpaceError) as raised:
        check_runnable(space, 2, "mine.toml")
    message = str(raised.value)
    assert message.startswith("mine.toml: sweep.seq_lens[1]: seq_len 3 "), message
    assert "On 8 ranks" in message and "shorter than 8 ranks" in message
    # with 1 rank in the list the same space runs
    check_runnable(load_space(write(tmp_path, text.replace("[4, 8]", "[1, 8]"))), 2, "mine.toml")


def test_rank_counts_auto_and_explicit(tmp_path):
    auto = load_space(write(tmp_path, BASE))
    assert auto.ranks is None
    assert auto.rank_counts(4) == (1, 2, 3, 4)
    assert auto.rank_counts(1) == (1,)
    with pytest.raises(ValueError):
        auto.rank_counts(0)
    with_ranks = edited("seq_lens = [64, 128]", "seq_lens = [64, 128]\nranks = [8, 2]")
    explicit = load_space(write(tmp_path, with_ranks))
    assert explicit.rank_counts(4) == (8, 2)  # as given; above 4 is not refused (oversubscribe)
    check_runnable(explicit, 4, "x")
    named_auto = edited("seq_lens = [64, 128]", 'seq_lens = [64, 128]\nranks = "auto"')
    assert load_space(write(tmp_path, named_auto)).ranks is None


# --------------------------------------------------------------------------- resolve


def test_resolve_space_prefers_an_existing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("demo").write_text(BASE)  # a local file named like a built-in wins
    assert resolve_space("demo") == Path("demo")
    assert load_space(resolve_space("demo")).name == "t"
    other = write(tmp_path, BASE, name="mine.toml")
    assert resolve_space(str(other)) == other


def test_resolve_space_finds_builtin_names():
    path = resolve_space("flux1-dev")
    assert path.is_file() and path.name == "flux1-dev.toml"
    assert resolve_space(DEMO_SPACE).name == "demo.toml"


def test_resolve_space_refuses_unknown_names_listing_the_builtins():
    with pytest.raises(SpaceError) as raised:
        resolve_space("flux1dev")
    message = str(raised.value)
    assert message.startswith("flux1dev: (file): no such file and no built-in space")
    assert "did you mean 'flux1-dev'" in message
    assert ", ".join(SHIPPED) in message

