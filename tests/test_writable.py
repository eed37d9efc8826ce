"""Whether a run can write where it is told to is tried, not read from permission bits (root passes those)."""

from lightning_dist.lifecycle.writable import unwritable_because


def test_a_directory_still_to_be_made_is_judged_by_where_it_would_be_made(tmp_path):
    assert unwritable_because(tmp_path / "logs" / "train") is None
    assert not (tmp_path / "logs").exists()  # asking made nothing


def test_a_path_under_a_file_is_refused(tmp_path):
    (tmp_path / "logs").write_text("")
    assert unwritable_because(tmp_path / "logs" / "train") == f"{tmp_path / 'logs'} is a file, not a directory"


def test_a_file_system_nobody_may_write_is_refused_even_for_root():
    assert unwritable_because("/sys/lightning_dist_logs") in ("/sys: permission denied", "/sys: operation not permitted",
                                                             "/sys: read-only file system")
