"""Training over several machines: `hybridtune train --nnodes N --node_rank R --master_addr A [--master_port P]
--nproc K` launches torchrun with those flags on each machine; the run trains what one process trains.

On the CPU two "machines" are two launchers on one host (gloo, one process each), which torchrun cannot tell from two
hosts: separate agents meeting at node 0's address, LOCAL_WORLD_SIZE 1 of WORLD_SIZE 2. Tolerances: test_distributed's
(the same micro-batches, only the order of fp32 sums differs)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_runs import ENV, STEPS, args, assert_same_curve, records, settings, train_here

from hybridtune.errors import ConfigError
from hybridtune.train.command import Launch, _take_launch, main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launcher_flags_are_taken_out_of_the_config_arguments():
    how, rest = _take_launch(
        [
            "--nnodes",
            "2",
            "--node_rank=1",
            "--master-addr",
            "10.1.2.3",
            "--master_port",
            "29600",
            "--nproc",
            "4",
            "--lr",
            "1e-4",
        ]
    )
    assert how == Launch(nproc=4, nnodes=2, node_rank=1, master_addr="10.1.2.3", master_port=29600)
    assert rest == ["--lr", "1e-4"] and how.world == 8
    assert how.torchrun_args() == [
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=10.1.2.3",
        "--master-port=29600",
        "--nproc-per-node=4",
        "--max-restarts=0",
    ]
    one, rest = _take_launch(["--nproc_per_node=2"])
    assert one == Launch(nproc=2) and rest == []
    assert one.torchrun_args() == ["--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    assert _take_launch(["--nnodes", "2", "--node_rank", "0", "--master_addr", "h"])[0].master_port == 29500


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--nnodes", "2", "--master_addr", "h"], "--nnodes 2 needs --node_rank"),
        (["--nnodes", "2", "--node_rank", "1"], "--nnodes 2 needs --master_addr"),
        (["--nnodes", "2", "--node_rank", "2", "--master_addr", "h"], "--node_rank 2 is not below --nnodes 2"),
        (["--node_rank", "1", "--master_addr", "h"], "--node_rank, --master_addr without --nnodes"),
        (["--nnodes", "0"], "--nnodes '0' must be a positive number"),
        (["--nnodes", "2", "--node_rank", "-1", "--master_addr", "h"], "--node_rank '-1' must be a number from 0"),
        (["--nnodes", "2", "--node_rank", "0", "--master_addr", "h", "--master_port", "x"], "--master_port 'x'"),
        (["--nnodes"], "--nnodes needs a value"),
        (
            ["--nnodes", "2", "--node_rank", "0", "--master_addr", "h", "--master_port", "70000"],
            "--master_port '70000' must be a positive number up to 65535",
        ),
    ],
)
def test_launcher_flag_mistakes_are_one_line_config_errors(argv, said):
    with pytest.raises(ConfigError, match=said):
        main(argv)


def test_the_window_splits_over_every_machines_processes_before_any_launch(tmp_path):
    """gradient_accumulation_steps must divide by nnodes x nproc (the world), not by nproc alone."""
    argv = ["--nnodes", "2", "--node_rank", "0", "--master_addr", "127.0.0.1", "--nproc", "1"]
    with pytest.raises(ConfigError, match="not a multiple of the 2 processes"):
        main([*argv, "--gradient_accumulation_steps", "3", "--output_dir", str(tmp_path / "o")])


@pytest.mark.slow
@pytest.mark.torchrun  # twice
def test_two_nodes_train_what_one_process_trains(tmp_path, small_data):
    port = free_port()
    s = settings(small_data, "full", output_dir=tmp_path / "two")
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "hybridtune", "train", "--nnodes", "2", "--node_rank", str(rank)]
            + ["--master_addr", "127.0.0.1", "--master_port", str(port), "--nproc", "1", *args(s)],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        one = train_here(settings(small_data, "full", output_dir=tmp_path / "one"))  # while the nodes start
        outs = [node.communicate(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.communicate()
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-3000:]
    err0 = outs[0][1]
    assert "node 0 of 2 (2 processes in all)" in err0 and "2 processes on 2 machines" in err0, err0[-3000:]
    assert "x 2 processes (fsdp)" in err0, err0[-3000:]
    assert_same_curve(records(tmp_path / "two"), one)
    assert len(one) == STEPS
    assert (tmp_path / "two" / "final" / "model.safetensors").is_file()


RANKS = """
import pathlib, sys
from hybridtune.errors import ConfigError
from hybridtune.runtime import distributed
from hybridtune.runtime.adapter_kind import FULL
from hybridtune.runtime.nodes import check_shared_output_dir
d = distributed.init("fsdp", FULL, "cpu")
out = pathlib.Path(sys.argv[1])
if d.is_main:
    (out / "run.json").write_text("{}")
check_shared_output_dir(d, out / "run.json")  # every rank sees it
mine = out if d.is_main else out / "elsewhere"  # rank 1 looks at another directory: as a machine without the share
try:
    check_shared_output_dir(d, mine / "run.json")
except ConfigError as e:
    (out / f"rank{d.rank}.txt").write_text(str(e))
distributed.shutdown(d)
"""


@pytest.mark.slow
@pytest.mark.torchrun
def test_an_output_dir_not_shared_by_every_rank_is_refused_on_every_rank(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    r = subprocess.run([*cmd, str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [Path(tmp_path / f"rank{k}.txt").read_text() for k in (0, 1)]
    assert said[0] == said[1]
    assert said[0].startswith(f"output_dir '{tmp_path}' is not shared: rank 1 on ") and "rank 0 on" not in said[0]
