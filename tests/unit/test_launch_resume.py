"""What ps-launch says of the --checkpoint-dir it is given, before it starts anything: a finished job, a job
that stopped midway (it goes on), or nothing (a new job)."""

from __future__ import annotations

import json

from torchps.worker.launch import _finished_job_may_go_on


def test_a_folder_with_a_stopped_job_says_it_goes_on(tmp_path, capsys):
    (tmp_path / "journal" / "ps-0").mkdir(parents=True)
    (tmp_path / "journal" / "ps-0" / "log-000000.bin").write_bytes(b"\0" * 8)
    assert _finished_job_may_go_on(str(tmp_path), None)
    assert "holds a job that stopped before its end: it goes on from where it stood" in capsys.readouterr().out


def test_an_empty_folder_says_nothing_and_a_finished_job_is_named(tmp_path, capsys):
    assert _finished_job_may_go_on(str(tmp_path), None)
    assert capsys.readouterr().out == ""
    (tmp_path / "step-000000000100").mkdir()
    (tmp_path / "job-finished.json").write_text(json.dumps({"global_step": 100}))
    assert not _finished_job_may_go_on(str(tmp_path), None)
    assert "holds a job that already finished at global step 100" in capsys.readouterr().out
