"""ClusterEnv.from_environ: every launcher as a plain dict, and every contradiction as an error."""

from __future__ import annotations

import pytest

from ddpjob.errors import DDPJobError
from ddpjob.node.cluster import PORT_BASE, PORT_SPAN, ClusterEnv, port_for_job

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400",
            "TORCHELASTIC_RESTART_COUNT": "0"}


def slurm_task(procid: int, job_id: str = "4242", nodes: int = 2, per_node: int = 2, **extra: str) -> dict:
    """What an srun task of `sbatch --nodes=2 --ntasks-per-node=2` sees (the subset we read)."""
    ntasks = nodes * per_node
    env = {
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % per_node),
        "SLURM_NODEID": str(procid // per_node), "SLURMD_NODENAME": f"n{procid // per_node + 1}",
        "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_JOB_NODELIST": f"n[1-{nodes}]" if nodes > 1 else "n1",
        "SLURM_NODELIST": f"n[1-{nodes}]" if nodes > 1 else "n1",
        "SLURM_STEP_NODELIST": f"n[1-{nodes}]" if nodes > 1 else "n1",
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_JOB_PARTITION": "low",
    }
    env.update(extra)
    return env


def error_line(environ: dict, argv: list[str] | None = None, num_gpus: int = 0) -> str:
    with pytest.raises(DDPJobError) as exc:
        ClusterEnv.from_environ(environ, argv or [], num_gpus=num_gpus)
    line = exc.value.line()
    assert "\n" not in line and " Hint: " in line
    return line


# ------------------------------------------------------------------- each source
def test_single_process() -> None:
    env = ClusterEnv.from_environ({}, [], hostname="laptop")
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (0, 0, 1, 1)
    assert (env.node_rank, env.num_nodes, env.source, env.job_id) == (0, 1, "single", None)
    assert env.master_addr == "127.0.0.1" and env.hostname == "laptop"
    assert not env.is_distributed and env.is_rank0 and env.device == "cpu"


def test_torchrun() -> None:
    env = ClusterEnv.from_environ(TORCHRUN, ["selftest"])
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert (env.master_addr, env.master_port, env.source) == ("10.0.0.7", 29400, "torchrun")
    assert env.is_distributed and not env.is_rank0 and env.job_id is None


@pytest.mark.parametrize("argv", [["--local_rank", "1"], ["--local-rank=1"], ["run", "--local_rank=1"],
                                  ["--local-rank", "1", "job.toml"]])
def test_legacy_launch_local_rank_argument(argv: list[str]) -> None:
    environ = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}
    env = ClusterEnv.from_environ(environ, argv)
    assert env.local_rank == 1 and env.rank == 3 and env.source == "torchrun"


def test_legacy_argument_agrees_with_local_rank_variable() -> None:
    assert ClusterEnv.from_environ(TORCHRUN, ["--local-rank=1"]).local_rank == 1
    line = error_line(TORCHRUN, ["--local-rank=0"])
    assert "LOCAL_RANK=1" in line and "--local-rank=0" in line


def test_legacy_argument_without_rank_variables() -> None:
    assert "RANK" in error_line({}, ["--local_rank", "0"])


def test_legacy_argument_not_an_integer() -> None:
    assert "'x'" in error_line(TORCHRUN, ["--local_rank", "x"])


def test_local_backend() -> None:
    environ = dict(TORCHRUN, DDPJOB_JOB_ID="local-20240101-abc", DDPJOB_RESTART_COUNT="2",
                   MASTER_ADDR="127.0.0.1", DDPJOB_RUN_DIR="/runs/x")
    env = ClusterEnv.from_environ(environ, [])
    assert env.source == "local" and env.job_id == "local-20240101-abc" and env.restart_count == 2
    assert env.ddpjob_vars["DDPJOB_RUN_DIR"] == "/runs/x" and env.master_port == 29400
    assert env.port_derived  # the supervisor's pick, not the user's
    assert not ClusterEnv.from_environ(TORCHRUN, []).port_derived  # torchrun's --master-port is the user's


def test_torchrun_inside_slurm_keeps_job_id_and_restarts() -> None:
    environ = dict(TORCHRUN, SLURM_JOB_ID="77", SLURM_RESTART_COUNT="3", SLURM_STEP_ID="0")
    env = ClusterEnv.from_environ(environ, [])
    assert env.source == "torchrun" and env.job_id == "77" and env.restart_count == 3
    assert env.master_port == 29400  # torchrun's own MASTER_PORT, not the derived one


def test_torchrun_s_run_names_the_job_and_its_agent_outside_slurm_only() -> None:
    """runs/<name>-torchrun-<run id> (docs/api.md): --rdzv-id or the uuid torchrun makes up for one
    node, the agent's pid for a static rendezvous ("none"). The agent (this process's parent) is
    job.json's pid outside SLURM and the local backend only: there nothing else knows the job."""
    import os

    uuid = "365330c0-c391-40e8-a49c-c5977625ba37"
    for run_id, job_id in ((uuid, f"torchrun-{uuid}"), ("exp7", "torchrun-exp7"), ("none", f"torchrun-{os.getppid()}")):
        env = ClusterEnv.from_environ(dict(TORCHRUN, TORCHELASTIC_RUN_ID=run_id), [])
        assert (env.job_id, env.agent_pid) == (job_id, os.getppid())
    assert ClusterEnv.from_environ(TORCHRUN, []).agent_pid is None  # torch.distributed.launch: no agent
    inside = ClusterEnv.from_environ(dict(TORCHRUN, TORCHELASTIC_RUN_ID=uuid, SLURM_JOB_ID="77"), [])
    assert (inside.job_id, inside.agent_pid) == ("77", None)
    local = ClusterEnv.from_environ(dict(TORCHRUN, TORCHELASTIC_RUN_ID=uuid, DDPJOB_JOB_ID="local-5"), [])
    assert (local.job_id, local.agent_pid) == ("local-5", None)


def test_slurm_two_nodes_two_tasks_each() -> None:
    envs = [ClusterEnv.from_environ(slurm_task(r), []) for r in range(4)]
    assert [e.rank for e in envs] == [0, 1, 2, 3]
    assert [e.local_rank for e in envs] == [0, 1, 0, 1]
    assert [e.node_rank for e in envs] == [0, 0, 1, 1]
    assert [e.hostname for e in envs] == ["n1", "n1", "n2", "n2"]
    for e in envs:
        assert (e.world_size, e.local_world_size, e.num_nodes, e.source) == (4, 2, 2, "slurm")
        assert e.master_addr == "n1" and e.master_port == PORT_BASE + 4242 % PORT_SPAN
        assert e.job_id == "4242" and e.restart_count == 0 and e.slurm_step and e.hosts == ("n1", "n2")
        assert e.partition == "low"


def test_slurm_uneven_tasks_per_node() -> None:
    environ = slurm_task(4, nodes=2, per_node=3, SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="5",
                         SLURM_NPROCS="5", SLURM_TASKS_PER_NODE="3,2", SLURM_STEP_TASKS_PER_NODE="3,2",
                         SLURM_LOCALID="1", SLURM_NODEID="1")
    del environ["SLURM_NTASKS_PER_NODE"]
    env = ClusterEnv.from_environ(environ, [])
    assert (env.rank, env.local_rank, env.local_world_size, env.node_rank) == (4, 1, 2, 1)


def test_slurm_single_task_and_requeued() -> None:
    env = ClusterEnv.from_environ(slurm_task(0, job_id="9", nodes=1, per_node=1,
                                             SLURM_RESTART_COUNT="2"), [])
    assert (env.rank, env.world_size, env.source, env.restart_count) == (0, 1, "slurm", 2)
    assert not env.is_distributed and env.master_addr == "n1"


def test_slurm_batch_shell_with_one_task_is_a_single_rank() -> None:
    environ = {k: v for k, v in slurm_task(0, nodes=1, per_node=1).items() if "STEP" not in k}
    env = ClusterEnv.from_environ(environ, [])
    assert (env.rank, env.world_size, env.source, env.slurm_step) == (0, 1, "slurm", False)


def test_slurm_extras() -> None:
    env = ClusterEnv.from_environ(slurm_task(1, SLURM_JOB_END_TIME="1767225600", SLURM_ARRAY_TASK_ID="5",
                                             SLURM_ARRAY_JOB_ID="4240", SLURM_CPUS_PER_TASK="3",
                                             SUBMITIT_FOLDER="/runs/r1/submitit"), [], num_gpus=2)
    assert env.end_time == 1767225600.0 and env.array_task_id == 5 and env.array_job_id == "4240"
    assert env.cpus_per_task == 3 and env.submitit_folder == "/runs/r1/submitit" and env.gpus == 2


def test_an_array_task_is_named_by_array_and_index() -> None:
    # One task of every array has SLURM_JOB_ID equal to the array's id (548_1 had 548 on the
    # test cluster): that id would name the whole array to scontrol, so the job is 548_1 on every
    # path (ranks, torchrun, the batch shell). The port comes from SLURM_JOB_ID, unique per task.
    array = {"SLURM_ARRAY_JOB_ID": "548", "SLURM_ARRAY_TASK_ID": "1"}
    env = ClusterEnv.from_environ(slurm_task(0, job_id="548", **array), [])
    assert (env.job_id, env.master_port) == ("548_1", port_for_job("548"))
    other = ClusterEnv.from_environ(slurm_task(0, job_id="549", SLURM_ARRAY_JOB_ID="548",
                                               SLURM_ARRAY_TASK_ID="0"), [])
    assert (other.job_id, other.master_port) == ("548_0", port_for_job("549"))
    assert ClusterEnv.batch_shell({"SLURM_JOB_ID": "548", **array}).job_id == "548_1"
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "SLURM_JOB_ID": "548", **array}
    assert ClusterEnv.from_environ(torchrun, []).job_id == "548_1"
    # the local backend's own id wins, and a job outside an array keeps its plain id
    assert ClusterEnv.from_environ({**torchrun, "DDPJOB_JOB_ID": "local-7"}, []).job_id == "local-7"
    assert ClusterEnv.from_environ(slurm_task(0, job_id="548"), []).job_id == "548"


def test_a_restart_derives_another_port_and_one_the_user_set_stays() -> None:
    # every rank of one attempt agrees; a requeue (SLURM_RESTART_COUNT) or a restart in place
    # (the batch shell's DDPJOB_ATTEMPT) moves it, so a port another program took is left
    first = {ClusterEnv.from_environ(slurm_task(r), []).master_port for r in range(4)}
    again = {ClusterEnv.from_environ(slurm_task(r, DDPJOB_ATTEMPT="1"), []).master_port for r in range(4)}
    requeued = ClusterEnv.from_environ(slurm_task(0, SLURM_RESTART_COUNT="1"), []).master_port
    assert first == {port_for_job("4242")} and again == {port_for_job("4242", 1)} == {requeued}
    assert port_for_job("4242", 1) != port_for_job("4242") and 15000 <= port_for_job("4242", 7) < 30000
    assert ClusterEnv.from_environ(slurm_task(0), []).port_derived
    mine = ClusterEnv.from_environ(slurm_task(0, MASTER_PORT="23456", DDPJOB_ATTEMPT="1"), [])
    assert (mine.master_port, mine.port_derived) == (23456, False)


def test_explicit_master_variables_win() -> None:
    env = ClusterEnv.from_environ(slurm_task(2, MASTER_ADDR="10.1.2.3", MASTER_PORT="23456"), [])
    assert (env.master_addr, env.master_port) == ("10.1.2.3", 23456)
    env = ClusterEnv.from_environ({"MASTER_PORT": "24000"}, [])
    assert env.master_port == 24000


def test_reads_os_environ_and_argv_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(__import__("os").environ):
        if key.startswith(("SLURM", "RANK", "LOCAL_", "WORLD_", "MASTER_", "DDPJOB_", "GROUP_")):
            monkeypatch.delenv(key)
    monkeypatch.setattr("sys.argv", ["ddpjob", "selftest"])
    for key, value in slurm_task(3).items():
        monkeypatch.setenv(key, value)
    env = ClusterEnv.from_environ()
    assert (env.rank, env.local_rank, env.hostname) == (3, 1, "n2")


# ---------------------------------------------- what SLURM 22.05.8 really exports (test cluster)
# Captured with `env | grep SLURM` in job 3 (`sbatch --nodes=2 --ntasks-per-node=2`): its batch
# shell, `srun` task 3, `srun -n1 -N1 -w n2` and `srun -n3`; and in an `salloc -N2
# --ntasks-per-node=2` shell. Site-specific variables (uid, cluster name, ports) left out.
CAPTURED = {
    "batch": "SLURMD_NODENAME=n1 SLURM_GTIDS=0 SLURM_JOBID=3 SLURM_JOB_ID=3 SLURM_JOB_NODELIST=n[1-2] "
             "SLURM_JOB_NUM_NODES=2 SLURM_JOB_PARTITION=low SLURM_LOCALID=0 SLURM_NNODES=2 SLURM_NODEID=0 "
             "SLURM_NODELIST=n[1-2] SLURM_NPROCS=4 SLURM_NTASKS=4 SLURM_NTASKS_PER_NODE=2 SLURM_PROCID=0 "
             "SLURM_TASKS_PER_NODE=2(x2)",
    "salloc": "SLURM_JOBID=4 SLURM_JOB_ID=4 SLURM_JOB_NODELIST=n[1-2] SLURM_JOB_NUM_NODES=2 "
              "SLURM_JOB_PARTITION=low SLURM_NNODES=2 SLURM_NODELIST=n[1-2] SLURM_NPROCS=4 SLURM_NTASKS=4 "
              "SLURM_NTASKS_PER_NODE=2 SLURM_TASKS_PER_NODE=2(x2)",
    "task3": "SLURMD_NODENAME=n2 SLURM_GTIDS=2,3 SLURM_JOBID=3 SLURM_JOB_ID=3 SLURM_JOB_NODELIST=n[1-2] "
             "SLURM_JOB_NUM_NODES=2 SLURM_JOB_PARTITION=low SLURM_LOCALID=1 SLURM_NNODES=2 SLURM_NODEID=1 "
             "SLURM_NODELIST=n[1-2] SLURM_NPROCS=4 SLURM_NTASKS=4 SLURM_NTASKS_PER_NODE=2 SLURM_PROCID=3 "
             "SLURM_STEPID=0 SLURM_STEP_ID=0 SLURM_STEP_NODELIST=n[1-2] SLURM_STEP_NUM_NODES=2 "
             "SLURM_STEP_NUM_TASKS=4 SLURM_STEP_TASKS_PER_NODE=2(x2) SLURM_TASKS_PER_NODE=2(x2)",
    "one_task_on_n2": "SLURMD_NODENAME=n2 SLURM_GTIDS=0 SLURM_JOBID=3 SLURM_JOB_ID=3 "
                      "SLURM_JOB_NODELIST=n[1-2] SLURM_JOB_NUM_NODES=2 SLURM_JOB_PARTITION=low "
                      "SLURM_LOCALID=0 "
                      "SLURM_NNODES=1 SLURM_NODEID=0 SLURM_NODELIST=n[1-2] SLURM_NPROCS=1 SLURM_NTASKS=1 "
                      "SLURM_NTASKS_PER_NODE=2 SLURM_PROCID=0 SLURM_STEPID=1 SLURM_STEP_ID=1 "
                      "SLURM_STEP_NODELIST=n2 SLURM_STEP_NUM_NODES=1 SLURM_STEP_NUM_TASKS=1 "
                      "SLURM_STEP_TASKS_PER_NODE=1 SLURM_TASKS_PER_NODE=1",
    "three_tasks_rank2": "SLURMD_NODENAME=n2 SLURM_GTIDS=2 SLURM_JOBID=3 SLURM_JOB_ID=3 "
                         "SLURM_JOB_NODELIST=n[1-2] SLURM_JOB_NUM_NODES=2 SLURM_JOB_PARTITION=low "
                         "SLURM_LOCALID=0 SLURM_NNODES=2 SLURM_NODEID=1 SLURM_NODELIST=n[1-2] SLURM_NPROCS=3 "
                         "SLURM_NTASKS=3 SLURM_NTASKS_PER_NODE=2 SLURM_PROCID=2 SLURM_STEPID=2 "
                         "SLURM_STEP_ID=2 "
                         "SLURM_STEP_NODELIST=n[1-2] SLURM_STEP_NUM_NODES=2 SLURM_STEP_NUM_TASKS=3 "
                         "SLURM_STEP_TASKS_PER_NODE=2,1 SLURM_TASKS_PER_NODE=2,1",
}


def captured(name: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in CAPTURED[name].split())


def test_captured_srun_task() -> None:
    env = ClusterEnv.from_environ(captured("task3"), [])
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes, env.hostname, env.master_addr) == (1, 2, "n2", "n1")
    assert env.master_port == 15003 and env.job_id == "3"


def test_captured_batch_shell_looks_like_rank0_but_is_refused() -> None:
    line = error_line(captured("batch"))
    assert "SLURM_NTASKS=4 but SLURM_STEP_ID is not set" in line
    assert "the sbatch batch script of job 3" in line and "srun" in line


def test_captured_salloc_shell_is_refused() -> None:
    line = error_line(captured("salloc"))
    assert "SLURM_NTASKS=4" in line and "an salloc shell of job 4" in line and "srun" in line


def test_captured_single_task_step_on_the_second_node_uses_the_step_nodelist() -> None:
    env = ClusterEnv.from_environ(captured("one_task_on_n2"), [])
    assert (env.rank, env.world_size, env.num_nodes) == (0, 1, 1)
    assert env.master_addr == "n2"  # SLURM_NODELIST (n[1-2]) would say n1, where no rank runs


def test_captured_three_tasks_on_two_nodes() -> None:
    env = ClusterEnv.from_environ(captured("three_tasks_rank2"), [])
    assert (env.rank, env.world_size, env.local_world_size, env.node_rank) == (2, 3, 1, 1)


def test_ntasks_disagrees_with_step_num_tasks() -> None:
    line = error_line(dict(captured("task3"), SLURM_NTASKS="8"))
    assert "SLURM_NTASKS=8" in line and "SLURM_STEP_NUM_TASKS=4" in line


# ------------------------------------------------------------------- port and device
def test_port_window_is_below_the_ephemeral_range_and_deterministic() -> None:
    ports = [port_for_job(str(j)) for j in (1, 14999, 15000, 29999, 123456789, 2**40)]
    assert all(15000 <= p < 30000 < 32768 for p in ports)
    assert port_for_job("1") == 15001 and port_for_job("15000") == 15000
    assert port_for_job("100") != port_for_job("101")
    assert 15000 <= port_for_job("local-abc") < 30000
    assert port_for_job("local-abc") == port_for_job("local-abc")


def test_device_follows_local_rank_not_global_rank() -> None:
    # rank 3 is the second task on node 2: cuda:1 (rank % 4 GPUs would wrongly say cuda:3)
    env = ClusterEnv.from_environ(slurm_task(3), [], num_gpus=4)
    assert env.device == "cuda:1"
    assert ClusterEnv.from_environ(slurm_task(2), [], num_gpus=2).device == "cuda:0"
    assert ClusterEnv.from_environ(slurm_task(3), [], num_gpus=0).device == "cpu"


# ------------------------------------------------------------------- contradictions
def test_slurm_without_srun() -> None:
    environ = {k: v for k, v in slurm_task(0).items() if "STEP" not in k}
    line = error_line(environ)
    assert "SLURM_NTASKS=4" in line and "SLURM_STEP_ID" in line and "srun" in line


def test_slurm_ntasks_does_not_match_nodes_times_tasks_per_node() -> None:
    line = error_line(slurm_task(0, SLURM_NTASKS="3", SLURM_STEP_NUM_TASKS="3"))
    assert "SLURM_NTASKS=3" in line and "2(x2)" in line


def test_slurm_tasks_per_node_malformed() -> None:
    assert "SLURM_TASKS_PER_NODE='2(y2)'" in error_line(
        slurm_task(0, SLURM_TASKS_PER_NODE="2(y2)", SLURM_STEP_TASKS_PER_NODE="2(y2)"))


def test_rank_not_below_world_size() -> None:
    line = error_line(dict(TORCHRUN, RANK="4"))
    assert "RANK=4" in line and "WORLD_SIZE=4" in line
    line = error_line(slurm_task(0, SLURM_PROCID="7"))
    assert "SLURM_PROCID=7" in line and "SLURM_NTASKS=4" in line


def test_local_rank_not_below_local_world_size() -> None:
    line = error_line(dict(TORCHRUN, LOCAL_RANK="2"))
    assert "LOCAL_RANK=2" in line and "LOCAL_WORLD_SIZE=2" in line


def test_more_local_tasks_than_gpus() -> None:
    line = error_line(slurm_task(0), num_gpus=1)
    assert "2 tasks" in line and "1 GPU" in line and "--ntasks-per-node" in line


def test_gpus_counted_after_the_read_are_checked_the_same() -> None:
    """A rank reads its environment once, before torch; with_gpus adds the count torch sees."""
    env = ClusterEnv.from_environ(slurm_task(3), [])
    assert env.with_gpus(4) == ClusterEnv.from_environ(slurm_task(3), [], num_gpus=4)
    assert env.with_gpus(4).device == "cuda:1" and env.device == "cpu"
    with pytest.raises(DDPJobError, match="2 tasks on node .* but only 1 GPU"):
        env.with_gpus(1)


@pytest.mark.parametrize("key,value", [("SLURM_PROCID", "zero"), ("SLURM_NTASKS", "4.0"),
                                       ("SLURM_RESTART_COUNT", "x"), ("SLURM_JOB_END_TIME", "soon")])
def test_non_integer_slurm_values(key: str, value: str) -> None:
    assert f"{key}={value!r}" in error_line(slurm_task(1, **{key: value}))


def test_non_integer_torchrun_values() -> None:
    assert "WORLD_SIZE='four'" in error_line(dict(TORCHRUN, WORLD_SIZE="four"))


def test_world_size_without_master_addr() -> None:
    environ = {k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}
    assert "WORLD_SIZE=4" in error_line(environ) and "MASTER_ADDR" in error_line(environ)


def test_master_port_out_of_range() -> None:
    assert "MASTER_PORT=70000" in error_line(dict(TORCHRUN, MASTER_PORT="70000"))


def test_nodelist_and_node_count_disagree() -> None:
    line = error_line(slurm_task(0, SLURM_STEP_NUM_NODES="3"))
    assert "3" in line and "n[1-2]" in line
