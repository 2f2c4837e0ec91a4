"""Long silent waits say what they are doing: DeepSpeed's first CPU op build."""

from trainer.dist import announce_op_build, init_parallel


def test_the_first_deepspeed_op_build_is_announced(tmp_path, monkeypatch, capsys):
    init_parallel("cpu")  # DeepSpeed on its CPU accelerator (the session's process group)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there yet
    line = announce_op_build()
    assert line is not None and "first run only" in line and str(tmp_path / "deepspeed_shm_comm") in line
    assert line in capsys.readouterr().err
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").touch()
    assert announce_op_build() is None
