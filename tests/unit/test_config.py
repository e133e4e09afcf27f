"""config.py: every shipped job file validates; overrides and flags are typed; bad values are
refused with one found/expected line and a hint."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from ddpjob import config, jobfile, validate
from ddpjob.errors import UsageError
from runlogs import decisions

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted((REPO / "jobs").glob("*.toml"))


@pytest.mark.parametrize("job", JOBS, ids=[p.stem for p in JOBS])
def test_every_job_file_validates_and_round_trips(job: Path) -> None:
    cfg = jobfile.resolve(job)
    assert jobfile.from_json(cfg.to_json()) == cfg
    assert config.accumulation_for(cfg, cfg.slurm.world_size) >= 1


@pytest.mark.parametrize("job", JOBS, ids=[p.stem for p in JOBS])
def test_every_key_of_every_job_file_is_commented(job: Path) -> None:
    for n, line in enumerate(job.read_text().splitlines(), 1):
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line.split("=", 1)[1], f"{job.name}:{n} has no comment: {line!r}"


def test_job_recipes() -> None:
    smoke = jobfile.resolve(REPO / "jobs/smoke.toml")
    assert (smoke.slurm.nodes, smoke.slurm.tasks_per_node, smoke.slurm.gpus_per_node) == (1, 2, 0)
    assert smoke.train.model == "cnn_tiny" and smoke.data.dataset == "synthetic"
    assert 0 < smoke.train.max_steps <= 300 and smoke.checkpoint.every_steps == 50
    r18 = jobfile.resolve(REPO / "jobs/cifar10_resnet18.toml")
    assert (r18.slurm.tasks_per_node, r18.slurm.gpus_per_node, r18.slurm.time) == (4, 4, "04:00:00")
    assert (r18.slurm.signal, r18.slurm.signal_lead_s) == ("USR2", 120)
    t = r18.train
    assert (t.model, t.optimizer, t.momentum, t.nesterov, t.weight_decay, t.batch_size) == \
        ("resnet18", "sgd", 0.9, True, 5e-4, 128)
    assert t.cifar_stem and t.schedule == "cosine" and t.warmup_epochs > 0 and t.amp == "auto"
    assert t.lr == pytest.approx(0.1 * 128 * 4 / 128)  # linear scaling to the global batch
    r50 = jobfile.resolve(REPO / "jobs/cifar10_resnet50.toml")
    assert (r50.slurm.nodes, r50.slurm.tasks_per_node) == (2, 4) and r50.train.sync_batchnorm
    assert config.accumulation_for(r50, 8) == 2 and config.accumulation_for(r50, 4) == 4


def test_flags_win_over_set_which_wins_over_the_file(tmp_path: Path) -> None:
    cfg = jobfile.resolve(REPO / "jobs/smoke.toml",
                         ["train.lr=0.01", "slurm.nodes=3", "train.amp=\"bf16\"", "name=other"],
                         {"nodes": 2, "time": "1-00:00:00", "partition": None})
    assert (cfg.train.lr, cfg.slurm.nodes, cfg.slurm.time, cfg.train.amp, cfg.name) == \
        (0.01, 2, "1-00:00:00", "bf16", "other")
    assert cfg.slurm.partition == ""  # a flag left out (None) changes nothing


def test_set_values_are_typed() -> None:
    job = REPO / "jobs/smoke.toml"
    assert jobfile.resolve(job, ["train.lr=1"]).train.lr == 1.0  # int accepted as float
    assert jobfile.resolve(job, ["slurm.setup=[\"module load x\"]"]).slurm.setup == ("module load x",)
    assert jobfile.resolve(job, ["slurm.partition=low"]).slurm.partition == "low"  # bare word
    with pytest.raises(UsageError, match=r"slurm.nodes is 'two' \(str\), expected an integer"):
        jobfile.resolve(job, ["slurm.nodes=two"])
    with pytest.raises(UsageError, match="expected true or false"):
        jobfile.resolve(job, ["train.nesterov=1"])


@pytest.mark.parametrize("text, seconds", [
    ("30", 1800), ("30:15", 1815), ("04:00:00", 14400), ("1-0", 86400), ("1-02:30", 95400),
    ("2-00:00:10", 172810),
])
def test_parse_time_s(text: str, seconds: int) -> None:
    assert validate.parse_time_s(text) == seconds


def test_resume_hash_ignores_resources_but_not_the_recipe() -> None:
    cfg = jobfile.resolve(REPO / "jobs/cifar10_resnet50.toml")
    bigger = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, nodes=1))
    assert bigger.hash() == cfg.hash()
    other_lr = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=0.1))
    assert other_lr.hash() != cfg.hash()
    # kernel choice, not the recipe: a resume may switch deterministic kernels off for speed
    fast = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, deterministic=False))
    assert fast.hash() == cfg.hash()


def _raw(**sections) -> dict:
    raw = {"name": "t", "slurm": {}, "train": {}, "data": {}, "checkpoint": {}}
    for k, v in sections.items():
        raw[k.split("__")[0]][k.split("__")[1]] = v
    return raw


BAD = [
    (dict(slurm__nodes=0), "slurm.nodes is 0, expected a positive integer"),
    (dict(slurm__gpus_per_node=-1), "expected >= 0"),
    (dict(slurm__time="4h"), "not a SLURM time limit"),
    (dict(slurm__time="0"), "not a SLURM time limit"),
    (dict(slurm__signal="B:USR2"), "expected one of USR1"),
    (dict(slurm__signal="KILL"), "expected one of"),
    (dict(slurm__signal_lead_s=7200, slurm__time="01:00:00"), "below the time limit"),
    (dict(slurm__partition="lo'w"), "not a valid SLURM name"),
    (dict(slurm__account="a b"), "not a valid SLURM name"),
    (dict(slurm__mem="32 GB"), "not a SLURM memory size"),
    (dict(slurm__setup=["echo a\necho b"]), "contains a newline"),
    (dict(slurm__sbatch_extra=["--wrap=true;rm -rf ~"]), "sets --wrap"),
    (dict(slurm__sbatch_extra=["--output=/tmp/x"]), "sets --output"),
    (dict(slurm__sbatch_extra=["--partition=high"]), "set slurm.partition instead"),
    (dict(slurm__sbatch_extra=["--comment=a\nb"]), "one '--option=value' argument"),
    (dict(slurm__sbatch_extra=["-p high"]), "one '--option=value' argument"),
    (dict(train__amp="fp8"), "train.amp is 'fp8', expected one of auto, bf16, fp16, off"),
    (dict(train__global_batch_size=100, train__batch_size=32), "expected a multiple of 32"),
    (dict(train__lr=0), "train.lr is 0.0, expected > 0"),
    (dict(train__label_smoothing=1.0), "expected < 1"),
    (dict(data__dataset="imagenet"), "expected cifar10, synthetic"),
    (dict(data__synthetic_train=0), "data.synthetic_train is 0, expected a positive integer"),
    (dict(checkpoint__keep_last=0), "checkpoint.keep_last is 0, expected a positive integer"),
    (dict(checkpoint__every_minutes=-1.0), "expected >= 0"),
    (dict(checkpoint__snapshot_every="often"),
     "checkpoint.snapshot_every is 'often', expected a number of steps (0: never) or \"auto\""),
    (dict(checkpoint__snapshot_every=-2), "checkpoint.snapshot_every is -2, expected >= 0"),
    (dict(checkpoint__snapshot_every=True), "checkpoint.snapshot_every is True (bool), expected an integer or a string"),
    (dict(checkpoint__snapshot_dir="shm"), "checkpoint.snapshot_dir is 'shm', expected an absolute path on the nodes"),
]


@pytest.mark.parametrize("changes, message", BAD, ids=[m for _, m in BAD])
def test_bad_values_give_one_found_expected_line(changes: dict, message: str) -> None:
    with pytest.raises(UsageError) as exc:
        jobfile.from_dict(_raw(**changes))
    line = exc.value.line()
    assert message in line
    assert line.startswith("ddpjob: error: ") and ", expected" in line and ". Hint: " in line
    assert "\n" not in line


@pytest.mark.parametrize("name", ["my job", "a\nb", "$(id)", "a;b", "run%j", "../up", "-rf",
                                  "x" * 101, "", "back`tick`"])
def test_hostile_names_are_refused(name: str) -> None:
    with pytest.raises(UsageError, match="name .* expected letters, digits"):
        jobfile.from_dict({"name": name})


def test_unknown_keys_list_the_valid_ones() -> None:
    with pytest.raises(UsageError, match=r"unknown key 'slurm.nodez'.*expected one of: "
                       r"account, constraint.*nodes.*Hint: did you mean 'nodes'\?"):
        jobfile.from_dict({"slurm": {"nodez": 2}})
    with pytest.raises(UsageError, match=r"unknown key 'slurmm'.*expected one of: name, slurm, "
                       r"train, data, checkpoint"):
        jobfile.from_dict({"slurmm": {}})
    with pytest.raises(UsageError, match="expected a table"):
        jobfile.from_dict({"train": 3})
    # checkpoint.async is spelt as in TOML (the field is async_save)
    assert jobfile.from_dict({"checkpoint": {"async": True}}).checkpoint.async_save is True


@pytest.mark.parametrize("item, message", [
    ("train.lr", "has no '='"),
    ("lr=0.1", "is not section.key"),
    ("train.lr.x=1", "is not section.key"),
    ("bogus.lr=1", "is not section.key"),
    ("train.lrr=0.1", "unknown key 'train.lrr'"),
])
def test_bad_overrides(item: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        jobfile.resolve(REPO / "jobs/smoke.toml", [item])


def test_job_file_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found"):
        jobfile.resolve(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[slurm\nnodes = 1\n")
    with pytest.raises(UsageError, match="is not valid TOML"):
        jobfile.resolve(bad)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config.JobConfig().to_dict()))
    assert jobfile.read_run_config(run) == config.JobConfig()


# ------------------------------------------------------------------ the resume identity
def _config_tree(cls: type = config.JobConfig) -> list[type]:
    """JobConfig and every dataclass reachable through its fields' types (its sections)."""
    hints = typing.get_type_hints(cls)  # Annotated stripped: the field's own type
    nested = [t for f in dataclasses.fields(cls)
              if isinstance(t := hints[f.name], type) and dataclasses.is_dataclass(t)]
    return [cls, *(c for t in nested for c in _config_tree(t))]


def _undeclared(*classes: type) -> list[str]:
    return [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
            if config.resume_rule(cls, f.name) is None]


def test_every_field_declares_whether_a_resume_must_match_it() -> None:
    """Every field of the config tree (JobConfig, its sections, theirs) says Match, Free or
    MatchIfSet: a new field cannot slip into (or out of) the resume identity unnoticed."""
    tree = _config_tree()
    assert set(tree) == {config.JobConfig, *config.SECTIONS.values()}  # the walk reaches every section
    assert _undeclared(*tree) == []
    for cls in tree:
        for f in dataclasses.fields(cls):
            rule = config.resume_rule(cls, f.name)
            if rule == config.FREE and dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name]):
                # a Match field in a Free section would be ignored by the hash: none may say so
                inner = typing.get_type_hints(cls)[f.name]
                assert {config.resume_rule(inner, g.name) for g in dataclasses.fields(inner)} == {config.FREE}, f.name
            if rule == config.MATCH_IF_SET:  # left out at its default: there must be one to compare
                assert f.default is not dataclasses.MISSING, f"{cls.__name__}.{f.name}"

    @dataclasses.dataclass(frozen=True)
    class Grown(config.DataConfig):
        shuffle_buffer: int = 0  # a new key that says nothing

    assert _undeclared(Grown) == ["Grown.shuffle_buffer"]
    with pytest.raises(AssertionError, match="shuffle_buffer declares no resume rule"):
        dataclasses.replace(config.JobConfig(), data=Grown()).hash()

    @dataclasses.dataclass(frozen=True)
    class GrownFree(config.CheckpointConfig):  # in a Free section, still looked at
        fancy: int = 0

    assert _undeclared(GrownFree) == ["GrownFree.fancy"]
    with pytest.raises(AssertionError, match="fancy declares no resume rule"):
        dataclasses.replace(config.JobConfig(), checkpoint=GrownFree()).hash()


def test_a_match_field_in_a_free_section_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Tuned(config.CheckpointConfig):
        tuned: config.Match[int] = 0

    with pytest.raises(AssertionError, match="Tuned.tuned says 'resume: match' inside a Free section"):
        dataclasses.replace(config.JobConfig(), checkpoint=Tuned()).hash()


def test_a_field_added_later_leaves_older_hashes_alone_at_its_default() -> None:
    """MatchIfSet: a config written before the field existed hashes as it did; another value is
    another training."""
    @dataclasses.dataclass(frozen=True)
    class Later(config.TrainConfig):
        mixup: config.MatchIfSet[float] = 0.0

    base = jobfile.resolve(REPO / "jobs/smoke.toml")
    grown = dataclasses.replace(base, train=Later(**{f.name: getattr(base.train, f.name)
                                                     for f in dataclasses.fields(config.TrainConfig)}))
    assert grown.hash() == base.hash()
    assert dataclasses.replace(grown, train=dataclasses.replace(grown.train, mixup=0.2)).hash() != base.hash()


def test_free_fields_leave_the_hash_alone_and_match_fields_change_it() -> None:
    base = config.JobConfig()
    for section, key, value in (("train", "max_steps", 7), ("train", "deterministic", False),
                                ("train", "compile_mode", "default"), ("data", "root", "/elsewhere"),
                                ("slurm", "nodes", 4), ("checkpoint", "every_steps", 3)):
        changed = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **{key: value})})
        assert changed.hash() == base.hash(), f"{section}.{key}"
    for section, key, value in (("train", "lr", 0.2), ("train", "model", "resnet8"), ("data", "augment", False),
                                ("train", "strategy", "fsdp")):
        changed = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **{key: value})})
        assert changed.hash() != base.hash(), f"{section}.{key}"
    assert dataclasses.replace(base, user={"width": 2}).hash() != base.hash()


# The hashes that existing run dirs and checkpoints carry, computed by the code at 9124a08 (the
# blacklist's successor, equal to 0.2's): a change here makes every such run refuse to resume.
PINNED_HASHES = [
    ("jobs/smoke.toml", (), "5ab19242918784a1"),
    ("jobs/cifar10_resnet18.toml", (), "a19cfae35c040d80"),
    ("jobs/cifar10_resnet50.toml", (), "c9ff52e96633f348"),
    ("jobs/smoke.toml", ("train.strategy=fsdp",), "b056d94f541287db"),
    ("jobs/smoke.toml", ("train.lr=0.2", "train.seed=3"), "37bc54357d67b64a"),
    ("jobs/smoke.toml", ("train.max_steps=9", "slurm.nodes=4", "checkpoint.every_steps=7", "data.root=/x"),
     "5ab19242918784a1"),
    ("jobs/smoke.toml", ("train.compile=true", "train.compile_mode=default"), "10e7fc2c4d859cba"),
    ("jobs/smoke.toml", ('train.entry="json.tool:main"', 'train.args=["-a"]', "data.synthetic_train=64"),
     "aa57e7af9a01f7dc"),
    ("jobs/cifar10_resnet18.toml", ("train.strategy=fsdp", "train.compile=false", "train.amp=bf16"),
     "d69102f92bd5b804"),
]


@pytest.mark.parametrize("job, overrides, expected", PINNED_HASHES,
                         ids=[" ".join([j[5:], *o]) for j, o, _ in PINNED_HASHES])
def test_the_hashes_of_existing_runs_stay(job: str, overrides: tuple[str, ...], expected: str) -> None:
    assert jobfile.resolve(REPO / job, overrides).hash() == expected
    assert config.JobConfig().hash() == "ff37a4d9f28dea95"


# Run dirs written by earlier code: config.json + the checkpoint of step 3 of smoke.toml on one
# rank (`ddpjob run jobs/smoke.toml --set train.max_steps=3 --set checkpoint.every_steps=3`;
# the 0.2 one's config.json then got max_steps = 6)
RESUME_FIXTURES = {
    "0.2": REPO / "tests" / "golden" / "resume-0.2",  # ddpjob 0.2 (ebbfe03)
    "9124a08": REPO / "tests" / "golden" / "resume-9124a08",  # main before the declared identity's tree walk
}


@pytest.mark.parametrize("made_by", RESUME_FIXTURES)
def test_a_config_written_by_earlier_code_hashes_as_its_checkpoint_says(made_by: str) -> None:
    fixture = RESUME_FIXTURES[made_by]
    cfg = jobfile.from_json((fixture / "config.json").read_text())
    manifest = json.loads((fixture / "checkpoints" / "step-000000003" / "manifest.json").read_text())
    assert manifest["versions"]["ddpjob"] == "0.2.0"
    assert cfg.hash() == manifest["config_hash"] == "5ab19242918784a1"


@pytest.mark.parametrize("made_by", RESUME_FIXTURES)
def test_a_run_dir_written_by_earlier_code_resumes(made_by: str, tmp_path: Path) -> None:
    """The committed run dir resumes under today's code: from step 3, to step 6."""
    import os
    import shutil
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(RESUME_FIXTURES[made_by], run)
    # max_steps may change at a resume (Free): the 9124a08 run ended at 3, it goes on to 6
    raw = json.loads((run / "config.json").read_text())
    raw["train"]["max_steps"] = 6
    (run / "config.json").write_text(json.dumps(raw))
    for p in [run, *run.rglob("*")]:  # a run dir others can write is refused (rundir.py)
        p.chmod(0o700 if p.is_dir() else 0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                       "MASTER_", "DDPJOB_", "TORCHELASTIC"))}
    # the code is not the fixture's any more: the flag that accepts that (a new code hash) is the user's
    out = subprocess.run([sys.executable, "-m", "ddpjob", "run", str(run), "--allow-code-change"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e.get("resumed_step") for e in events if e["event"] == "start"] == [3]
    assert [e["step"] for e in decisions(events)] == [6]
    assert (run / "COMPLETED").exists()
