"""zeroshard.install_as_deepspeed(), each case in a fresh interpreter (imports are process-wide)."""

import subprocess
import sys
import textwrap

import pytest


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_import_deepspeed_is_zeroshard_and_hugging_face_sees_it() -> None:
    proc = python("""
        import importlib.metadata, importlib.util
        import zeroshard
        zeroshard.install_as_deepspeed()
        zeroshard.install_as_deepspeed()  # idempotent
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.ops.adam import FusedAdam
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        assert deepspeed is zeroshard and deepspeed.zero is zeroshard.zero
        assert zeroshard.__spec__.name == "zeroshard" and zeroshard.runtime.zero.__spec__.name == "zeroshard.deepspeed.runtime.zero"
        assert ZeroParamStatus is zeroshard.zero.ZeroParamStatus
        assert importlib.util.find_spec("deepspeed") is not None
        assert importlib.metadata.version("deepspeed") == "0.18.2"
        assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"
        from transformers.integrations.deepspeed import is_deepspeed_available as hf
        from accelerate.utils import is_deepspeed_available as acc
        assert hf() and acc()
        try:
            import deepspeed.no_such_module
        except ModuleNotFoundError as err:
            assert "zeroshard stands in for deepspeed" in str(err)
        else:
            raise AssertionError("imported a module that does not exist")
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_without_install_there_is_no_deepspeed() -> None:
    proc = python("""
        import importlib.util
        import zeroshard
        print(importlib.util.find_spec("deepspeed") is None)
    """)
    assert proc.stdout.strip() == "True", proc.stderr


def test_installing_after_hugging_face_is_imported_is_refused() -> None:
    proc = python("""
        import accelerate.utils
        import zeroshard
        try:
            zeroshard.install_as_deepspeed()
        except ImportError as err:
            print(type(err).__name__, err)
    """)
    assert proc.stdout.startswith("InstalledTooLateError accelerate.utils") and "already imported" in proc.stdout, \
        proc.stderr


def test_a_real_deepspeed_already_imported_is_refused() -> None:
    proc = python("""
        import sys, types
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # stands for a real DeepSpeed
        import zeroshard
        try:
            zeroshard.install_as_deepspeed()
        except ImportError as err:
            print(type(err).__name__, err)
    """)
    assert proc.stdout.startswith("DeepSpeedAlreadyImportedError a real DeepSpeed is already imported"), proc.stderr


@pytest.mark.parametrize("args, expected", [
    (["--as-deepspeed", "--num_gpus", "2", "t.py", "--num_gpus", "9"],
     ["--nproc_per_node", "2", "-m", "zeroshard.deepspeed.bootstrap", "t.py", "--num_gpus", "9"]),
    (["--master_port=29999", "--master_addr", "10.0.0.1", "--num_nodes", "1", "t.py"],
     ["--master_port", "29999", "--master_addr", "10.0.0.1", "t.py"]),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "t.py", "-x"], ["--nnodes", "2", "--rdzv-endpoint", "h:1", "t.py", "-x"]),
    # restarts on one node get the c10d (standalone) rendezvous: see [Note: restarts need a fresh store]
    (["--nproc-per-node", "2", "--max-restarts", "3", "t.py"],
     ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "t.py"]),
    (["--max_restarts=1", "--nnodes", "1", "t.py"], ["--standalone", "--max_restarts=1", "--nnodes", "1", "t.py"]),
    (["--max-restarts", "0", "t.py"], ["--max-restarts", "0", "t.py"]),
    (["--max-restarts", "2", "--rdzv-backend", "c10d", "t.py"], ["--max-restarts", "2", "--rdzv-backend", "c10d", "t.py"]),
])
def test_launcher_flags_become_torchrun_flags(args, expected) -> None:
    from zeroshard.deepspeed.launcher import torchrun_arguments

    assert torchrun_arguments(args) == expected


def test_bootstrap_passes_local_rank_only_to_scripts_that_declare_it(tmp_path, monkeypatch) -> None:
    from zeroshard.deepspeed.bootstrap import script_argv

    monkeypatch.setenv("LOCAL_RANK", "3")
    declares, plain = tmp_path / "a.py", tmp_path / "b.py"
    declares.write_text('parser.add_argument("--local_rank", type=int)\n')
    plain.write_text("print(1)\n")
    assert script_argv(str(declares), ["--x"]) == [str(declares), "--local_rank=3", "--x"]
    assert script_argv(str(plain), ["--x"]) == [str(plain), "--x"]
    assert script_argv(str(declares), ["--local_rank=1"]) == [str(declares), "--local_rank=1"]


def test_torchrun_gets_a_fresh_store_per_restart_unless_the_user_chose() -> None:
    from zeroshard.deepspeed.launcher import torchrun_environment

    assert torchrun_environment({"PATH": "/bin"}) == {"PATH": "/bin", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert torchrun_environment({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"
