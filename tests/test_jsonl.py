"""taps.core.jsonl.read_json: the one reader of whole JSON documents (run.json, manifests, summaries,
tables, checkpoint state, cached profiles, configs): a bad file is one error naming the file,
where it breaks and what was expected."""

from __future__ import annotations

import pytest

from taps.core.jsonl import JsonlFormatError, read_json, read_json_lines, write_jsonl


class Mine(ValueError):
    pass


def test_a_document_is_read(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"tree": [60, 5, 10], "name": "caf\u00e9"}', encoding="utf-8")
    assert read_json(path, "a run") == {"tree": [60, 5, 10], "name": "caf\u00e9"}
    (tmp_path / "list.json").write_text("[1, 2]")
    assert read_json(tmp_path / "list.json", "a table", kind=None) == [1, 2]
    assert read_json(tmp_path / "list.json", "a table", kind=list) == [1, 2]


@pytest.mark.parametrize("content, message", [
    (b'{"a": 1,\n "b": }', r"run\.json: not valid JSON \(Expecting value at line 2, column 7\); expected a run's settings"),
    (b"", r"run\.json: not valid JSON \(Expecting value at line 1, column 1\)"),
    (b'{"a": "caf\xe9"}', r"run\.json:1: not UTF-8 text \(byte 0xe9 at column 11\)"),
    (b"[1, 2]", r"run\.json: a JSON array, not an object; expected a run's settings"),
    (b'"text"', r"run\.json: a JSON string, not an object"),
])
def test_a_bad_document_names_the_file_and_what_was_expected(tmp_path, content, message):
    path = tmp_path / "run.json"
    path.write_bytes(content)
    with pytest.raises(Mine, match=message) as err:
        read_json(path, "a run's settings", Mine)
    assert "\n" not in str(err.value)
    with pytest.raises(JsonlFormatError):  # the default error type
        read_json(path, "a run's settings")


def test_a_missing_file_is_the_callers_to_report(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "absent.json", "anything")


def test_gz_names_are_compressed_both_ways_and_reproducible(tmp_path):
    import gzip

    records = [{"id": i, "text": "é\u2028" * i} for i in range(5)]
    path = write_jsonl(records, tmp_path / "data.jsonl.gz")
    assert gzip.decompress(path.read_bytes()).decode().count("\n") == 5
    assert [r for _, r in read_json_lines(path)] == records
    first = path.read_bytes()
    write_jsonl(records, path)
    assert path.read_bytes() == first  # no time stamp in the header
    (tmp_path / "cut.jsonl.gz").write_bytes(first[:-8])
    with pytest.raises(JsonlFormatError, match=r"cut\.jsonl\.gz: not a complete gzip file"):
        read_json_lines(tmp_path / "cut.jsonl.gz")
