"""RecordWriter: preference pairs written to JSONL or parquet read back to the same records."""

import io

import pytest
from PIL import Image

from rl_data.readers import read_preferences
from rl_data.records import ImageSource, PreferenceRecord
from rl_data.writers import RecordWriter, preference_row


def _png(colour):
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_preference_row_writes_every_member_as_bytes_and_path():
    record = PreferenceRecord(prompt="a clip", chosen="/v/a.mp4", rejected="/v/b.mp4", fields={"id": 2})
    assert preference_row(record) == {"prompt": "a clip", "chosen": {"bytes": None, "path": "/v/a.mp4"},
                                      "rejected": {"bytes": None, "path": "/v/b.mp4"}, "id": 2}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_preference_pairs_of_images_and_videos_round_trip(tmp_path, suffix):
    records = [
        PreferenceRecord(prompt="red", chosen=ImageSource(bytes=_png((200, 0, 0))),
                         rejected=ImageSource(bytes=_png((0, 0, 200)), path=str(tmp_path / "orig.png")), fields={"id": 0}),
        PreferenceRecord(prompt="a square", chosen=ImageSource(path=str(tmp_path / "a.png")),
                         rejected=ImageSource(path=str(tmp_path / "b.png")), fields={"id": 1}),
        PreferenceRecord(prompt="a clip", chosen=str(tmp_path / "a.gif"), rejected=str(tmp_path / "b.mp4"),
                         fields={"id": 2}),
    ]
    path = tmp_path / f"pairs{suffix}"
    with RecordWriter(path, "preference") as writer:
        assert writer.write_all(records) == 3
    back = list(read_preferences(path, media_root="/elsewhere"))  # written paths are absolute
    assert back == records
    assert [r.media for r in back] == ["image", "image", "video"]


def test_preference_writer_refuses_a_manifest_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"preference records are written to .jsonl or .parquet files, not '.txt'"):
        RecordWriter(tmp_path / "pairs.txt", "preference")
