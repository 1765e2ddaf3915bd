"""Two torchrun agents on this machine act as two nodes (c10d rendezvous over loopback), two processes
each: every stage that shards trains exactly as one process on the whole global batch, ranks and local
ranks are what torchrun gives, only global rank 0 logs, and a checkpoint saved across the two "nodes"
consolidates to the same weights.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest
import torch
from zs_common import make_model, single_process_reference, zero_config

import zeroshard

from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.consolidate import full_state_dict
from zeroshard.tools.testing import run_world

SCRIPT = Path(__file__).parent / "multinode_scripts" / "train_global_batch.py"
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_agents(out: Path, stage: int, nodes: Optional[list["Namespace"]] = None, mode: str = "shared",
                   hybrid: str = "") -> list[subprocess.CompletedProcess]:
    """`zeroshard run` twice, as on two nodes of a cluster: the same rendezvous endpoint and id.  With
    ``nodes``, each agent runs in its own network namespace and talks over the veth pair only."""
    port = free_port()
    host = nodes[0].address if nodes else "127.0.0.1"
    agents = []
    for node in range(2):
        prefix, env = [], dict(os.environ)
        local_addr = []
        if nodes:
            prefix = ["ip", "netns", "exec", nodes[node].name]
            env["GLOO_SOCKET_IFNAME"] = nodes[node].interface  # gloo's traffic on the veth pair
            # what the agent tells the others, and which one hosts the rendezvous (torch cannot tell by
            # its hostname inside a namespace)
            local_addr = ["--local-addr", nodes[node].address, "--rdzv-conf", f"is_host={node == 0}"]
        command = [*prefix, sys.executable, "-m", "zeroshard.tools.cli", "run", "--nnodes", "2", "--node-rank",
                   str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
                   "--rdzv-id", f"zs{stage}{mode}{hybrid}", *local_addr, str(SCRIPT), str(out), str(stage),
                   str(STEPS), mode, hybrid]
        agents.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=env))
    done = []
    for agent in agents:
        stdout, _ = agent.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, ""))
    return done


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, the whole global batch (4 ranks x 2 micro batches x 2 rows), AdamW, clipping."""
    return single_process_reference(steps, 4, 2, 2)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_two_agents_as_two_nodes_train_as_one_process_and_resume_from_node_local_checkpoints(tmp_path: Path) -> None:
    """Stage 3 (whose gathers cross the nodes too), the agents in two network namespaces joined by a veth
    pair where namespaces can be made (root, `ip`), else both on the loopback interface.  The run saves
    with checkpoint.use_node_local_storage before its last step, each "node" into a directory only it
    uses; a new job resumes from them, each rank reading its own node's files, bitwise equal to the
    uninterrupted run."""
    with two_namespaces(required=False) as nodes:
        check_two_node_run(tmp_path, 3, run_two_agents(tmp_path, 3, nodes, mode="node_local_save"),
                           mode="node_local_save")
        placements = [json.loads((tmp_path / f"placement{r}.json").read_text()) for r in range(4)]
        assert all(p["sent"]["inside_node"] == 0 < p["sent"]["across_nodes"] for p in placements)  # groups span both
        for node, agent in enumerate(run_two_agents(tmp_path, 3, nodes, mode="node_local_resume")):
            assert agent.returncode == 0, f"node_local_resume, agent {node}:\n{agent.stdout[-4000:]}"
    check_node_local_checkpoints(tmp_path, 3)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("hybrid", ["mics"])  # hpZ's groups per node: test_hybrid.py (ranks told their node)
def test_two_agents_with_hybrid_sharding_train_as_one_process(hybrid: str, tmp_path: Path) -> None:
    """MiCS with a group per node (torchrun's nodes): the same weights as one process; it sends across
    nodes only the once-per-step all-reduce of each gradient shard (fp32: 2 (R-1)/R x 4 bytes per shard
    element, R = 2 replicas).  hpZ's groups per node are tested with ranks told their node (test_hybrid.py)."""
    check_two_node_run(tmp_path, 3, run_two_agents(tmp_path, 3, hybrid=hybrid))
    placements = [json.loads((tmp_path / f"placement{r}.json").read_text()) for r in range(4)]
    for p in placements:
        assert p["sent"]["inside_node"] > 0
        if hybrid == "mics":
            assert p["sent"]["across_nodes"] == STEPS * sum(shard * 4 for _, shard in p["layout"])


@dataclass
class Namespace:
    name: str
    interface: str
    address: str


@contextlib.contextmanager
def two_namespaces(required: bool = True) -> Iterator[Optional[list[Namespace]]]:
    """Two network namespaces joined by a veth pair (10.211.x.0/24 addresses, inside them only);
    removed afterwards.  Where they cannot be made (not root, no `ip`): skips, saying why, or without
    ``required`` yields None (the agents then share the loopback interface)."""
    if shutil.which("ip") is None:
        if required:
            pytest.skip("no `ip` command: network namespaces cannot be created here")
        yield None
        return
    tag = f"{os.getpid() % 100000}"
    nodes = [Namespace(f"zsA{tag}", f"zsa{tag}", "10.211.7.1"), Namespace(f"zsB{tag}", f"zsb{tag}", "10.211.7.2")]
    steps = [["ip", "netns", "add", nodes[0].name], ["ip", "netns", "add", nodes[1].name],
             ["ip", "link", "add", nodes[0].interface, "netns", nodes[0].name, "type", "veth", "peer", "name",
              nodes[1].interface, "netns", nodes[1].name]]
    for node in nodes:
        steps += [["ip", "-n", node.name, "addr", "add", f"{node.address}/24", "dev", node.interface],
                  ["ip", "-n", node.name, "link", "set", node.interface, "up"],
                  ["ip", "-n", node.name, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            made = subprocess.run(step, capture_output=True, text=True)
            if made.returncode != 0:
                if required:
                    pytest.skip(f"cannot create network namespaces here ({' '.join(step)}: {made.stderr.strip()})")
                break
        else:
            yield nodes
            return
        yield None
    finally:
        for node in nodes:
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)


def check_two_node_run(tmp_path: Path, stage: int, agents: list[subprocess.CompletedProcess],
                       mode: str = "shared") -> None:
    for node, agent in enumerate(agents):
        assert agent.returncode == 0, f"{mode}, agent {node}:\n{agent.stdout[-4000:]}"
    placements = [json.loads((tmp_path / f"placement{r}.json").read_text()) for r in range(4)]
    assert [p["world_size"] for p in placements] == [4] * 4
    assert sorted((p["group_rank"], p["local_rank"]) for p in placements) == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    assert all(p["local_world_size"] == "2" for p in placements)
    for p in placements:  # torchrun numbers ranks node by node
        assert p["rank"] == int(p["group_rank"]) * 2 + p["local_rank"]
    logs = "".join(agent.stdout for agent in agents)
    assert sum(f"step {s + 1}: loss" in line for line in logs.splitlines() for s in range(STEPS)) == STEPS
    expected = reference(STEPS)
    got = torch.load(tmp_path / f"final_{mode}.pt")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    if mode == "shared":
        saved = full_state_dict(tmp_path / "ckpt")
        for name, value in got.items():
            assert torch.equal(saved[name], value), name


def check_node_local_checkpoints(tmp_path: Path, stage: int) -> None:
    """Each node's directory holds its own ranks' files and the same manifest; the resumed job's weights
    are bitwise the uninterrupted run's; another world refuses the files by name."""
    tag = f"global_step{STEPS - 1}"
    held = [sorted(p.name for p in (tmp_path / f"node{n}" / tag).iterdir()) for n in range(2)]
    assert held[0] == ["manifest.json", "model_extra.safetensors", "rank00000.safetensors", "rank00001.safetensors"]
    assert held[1] == ["manifest.json", "model_extra.safetensors", "rank00002.safetensors", "rank00003.safetensors"]
    manifests = [(tmp_path / f"node{n}" / tag / "manifest.json").read_bytes() for n in range(2)]
    assert manifests[0] == manifests[1] and len(json.loads(manifests[0])["files"]) == 5
    assert all((tmp_path / f"node{n}" / "latest").read_text() == tag for n in range(2))
    uninterrupted = torch.load(tmp_path / "final_node_local_save.pt")
    resumed = torch.load(tmp_path / "final_node_local_resume.pt")
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name
    with pytest.raises(CheckpointError, match="node-local checkpoint: each node holds its own ranks' files"):
        full_state_dict(tmp_path / "node0")  # offline, one node's files are not the whole model
    messages = run_world(load_elsewhere, 2, args=(str(tmp_path / "node0"), stage))
    assert all("a node-local checkpoint (each node holds only its own ranks' files) saved with world size 4 (now 2)"
               in m for m in messages), messages


def load_elsewhere(rank: int, world: int, directory: str, stage: int) -> str:
    config = zero_config(stage, 2, 2, **({"stage3_param_persistence_threshold": 20} if stage == 3 else {}))
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config)
    try:
        engine.load_checkpoint(directory)
    except CheckpointError as err:
        return str(err)
    return "loaded"
