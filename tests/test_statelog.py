"""The state log: round trips, every torn tail, bit flips, bad headers, grouped fsync,
and bounded reads on a long log (asserted in bytes read, not time)."""

from __future__ import annotations

import os
import random
import shutil
import threading
import warnings

import msgpack
import pytest

from snapd.errors import CorruptLog
from snapd.logwriter import LogWriter
from snapd.statelog import (
    HEADER_SIZE,
    IOStats,
    LogDamageWarning,
    TornTailWarning,
    encode_header,
    find_last,
    find_step,
    last_record,
    list_ranks,
    list_segments,
    read_records,
    read_tail,
    scan_segment,
    tail_report,
)

from helpers import LONG_LOG_STEPS, logged_commit, logged_step, wait_for

pytestmark = pytest.mark.filterwarnings("ignore::snapd.statelog.TornTailWarning")


def step_record(i: int, **extra) -> dict:
    return {"kind": "step", "step": i, "time": 1.7e9 + i,
            "cursor": {"epoch": i // 100, "index": i % 100},
            "rng": {"python": (i * 2654435761) % 2**64, "torch": 2**64 - 1 - i},
            "scalars": {"loss": 1.0 / (i + 1), "lr": 3e-4}, **extra}


def no_fsync(fd: int) -> None:
    """fsync is not what these tests check; skipping it keeps hundreds of reopenings fast."""


def readers_agree(run, records, rank=0):
    """Every reader returns exactly ``records`` (the valid prefix), no more, no less."""
    assert list(read_records(run, rank)) == records
    assert read_tail(run, rank, 7) == records[-7:]
    assert last_record(run, rank) == (records[-1] if records else None)
    steps = [r for r in records if r["kind"] == "step"]
    assert find_last(run, rank, "step") == (steps[-1] if steps else None)
    for r in steps[-3:]:
        assert find_step(run, rank, r["step"]) == r


def write_crashed_log(run, n_synced, n_unsynced, **kw):
    """Records ``n_synced`` then sync, then ``n_unsynced`` never synced: a writer that
    dies here leaves exactly this file. Returns (records, segment path, frame offsets)."""
    w = LogWriter(run, 0, flush_interval=None, fsync=no_fsync, **kw)
    records, starts = [], []
    for i in range(n_synced + n_unsynced):
        if i == n_synced:
            w.sync()
        starts.append(os.path.getsize(list_segments(run, 0)[-1]) if i else HEADER_SIZE)
        records.append(step_record(i))
        w.append(records[-1])
    path = list_segments(run, 0)[-1]
    data = path.read_bytes()  # the file as a writer dying here leaves it (close seals it)
    w.close()
    return records, path, starts + [len(data)], data


def test_round_trip_across_rotation(tmp_path):
    records = [step_record(i) for i in range(400)]
    records[123] = {"kind": "snapshot", "event": "committed", "step": 122, "blob": b"\x00" * 300}
    with LogWriter(tmp_path, 3, segment_bytes=4096, flush_interval=None) as w:
        for r in records:
            w.append(r)
    paths = list_segments(tmp_path, 3)
    assert len(paths) > 10 and all(p.stat().st_size <= 4096 + 40 for p in paths)
    assert paths[0].name == "000000000001.log"
    readers_agree(tmp_path, records, rank=3)
    for p in paths:
        _, report = scan_segment(p)
        assert report.torn_at is None and report.valid_end == report.size
    assert list_ranks(tmp_path) == [3]
    assert find_last(tmp_path, 3, "snapshot") == records[123]
    assert list(read_records(tmp_path, 3, start_step=390)) == records[390:]


def test_every_truncation_point_of_the_last_record(tmp_path):
    records, path, starts, data = write_crashed_log(tmp_path / "orig", 20, 10)
    last_start, last_end = starts[-2], starts[-1]
    for cut in range(last_start, last_end):
        run = tmp_path / f"cut{cut}"
        seg = run / "log" / "rank-00000" / path.name
        seg.parent.mkdir(parents=True)
        seg.write_bytes(data[:cut])
        readers_agree(run, records[:-1])
        report = tail_report(run, 0)
        assert report.valid_end == last_start
        assert report.torn_at == (None if cut == last_start else last_start)
        with warnings.catch_warnings():
            warnings.simplefilter("error" if cut > last_start else "ignore", TornTailWarning)
            if cut > last_start:
                with pytest.raises(TornTailWarning):
                    list(read_records(run, 0))
        with LogWriter(run, 0, flush_interval=None, fsync=no_fsync) as w:
            assert seg.stat().st_size > last_start  # tail cut, then a sync mark appended
            assert data[:last_start] == seg.read_bytes()[:last_start]
            w.append(step_record(29, again=True))
            w.append(step_record(30))
        readers_agree(run, records[:-1] + [step_record(29, again=True), step_record(30)])


def test_random_bit_flips_in_unsynced_records(tmp_path):
    records, path, starts, data = write_crashed_log(tmp_path / "orig", 30, 12)
    rng = random.Random(20240611)
    first = starts[30]  # the unsynced records begin here
    for trial in range(150):
        buf = bytearray(data)
        flips = [rng.randrange(first * 8, len(data) * 8) for _ in range(rng.choice([1, 1, 2, 3]))]
        for bit in flips:
            buf[bit // 8] ^= 1 << (bit % 8)
        k = min(max(i for i in range(len(records)) if starts[i] <= bit // 8) for bit in flips)
        run = tmp_path / f"t{trial}"
        seg = run / "log" / "rank-00000" / path.name
        seg.parent.mkdir(parents=True)
        seg.write_bytes(bytes(buf))
        readers_agree(run, records[:k])
        assert scan_segment(seg)[1].torn_at == starts[k]
        with LogWriter(run, 0, flush_interval=None, fsync=no_fsync) as w:
            w.append(step_record(k, retry=trial))
        readers_agree(run, records[:k] + [step_record(k, retry=trial)])
        shutil.rmtree(run)


def test_lost_page_before_surviving_frames_ends_the_prefix(tmp_path):
    """After a crash a later page can survive an earlier lost one: its frames still
    checksum, but the rule makes them invalid, and the tail readers must agree."""
    records, path, starts, data = write_crashed_log(tmp_path / "orig", 30, 30)
    buf = bytearray(data)
    buf[starts[40]:starts[43]] = bytes(starts[43] - starts[40])  # a page that never arrived
    run = tmp_path / "run"
    (run / "log" / "rank-00000").mkdir(parents=True)
    (run / "log" / "rank-00000" / path.name).write_bytes(bytes(buf))
    (run / "log" / "rank-00000" / "000000000002.log.tmp").write_bytes(b"half a header")
    readers_agree(run, records[:40])
    assert tail_report(run, 0).torn_at == starts[40]
    with LogWriter(run, 0, flush_interval=None, fsync=no_fsync) as w:
        w.append(step_record(40, after_crash=True))
    readers_agree(run, records[:40] + [step_record(40, after_crash=True)])


def test_bit_rot_in_fsynced_bytes_skips_only_the_altered_record(tmp_path):
    """Before the newest sync mark, damage is rot, not a crash: every reader warns with
    the segment and offset, skips the altered frame and reads the records after it. A
    hit on the only mark makes everything after it an unsynced tail again."""
    records, path, starts, data = write_crashed_log(tmp_path / "orig", 30, 5)
    rng = random.Random(7)
    for trial in range(40):
        buf = bytearray(data)
        bit = rng.randrange(HEADER_SIZE * 8, starts[30] * 8)
        buf[bit // 8] ^= 1 << (bit % 8)
        k = max(i for i in range(len(records)) if starts[i] <= bit // 8)
        in_mark = bit // 8 >= starts[k] + 12 + len(msgpack.packb(records[k]))
        expect = records[:30] if in_mark else records[:k] + records[k + 1:]
        run = tmp_path / f"t{trial}"
        (run / "log" / "rank-00000").mkdir(parents=True)
        (run / "log" / "rank-00000" / path.name).write_bytes(bytes(buf))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            readers_agree(run, expect)
        if not in_mark:
            damage = [str(w.message) for w in seen if w.category is LogDamageWarning]
            assert damage and all(f"{path.name}: damaged state-log frame at offset "
                                  f"{starts[k]} " in m for m in damage), damage


def test_frame_copied_from_another_segment_is_invalid(tmp_path):
    with LogWriter(tmp_path, 0, segment_bytes=1024, flush_interval=None) as w:
        for i in range(40):
            w.append(step_record(i))
    first, last = list_segments(tmp_path, 0)[0], list_segments(tmp_path, 0)[-1]
    n = int.from_bytes(first.read_bytes()[HEADER_SIZE:HEADER_SIZE + 4], "little")
    stolen = first.read_bytes()[HEADER_SIZE:HEADER_SIZE + 12 + n]
    with open(last, "ab") as f:
        f.write(stolen)
    assert list(read_records(tmp_path, 0))[-1] == step_record(39)
    assert tail_report(tmp_path, 0).reason == "checksum mismatch"


@pytest.mark.parametrize("field", ["magic", "version", "checksum", "header_size", "rank",
                                   "seq", "header"])
def test_bad_header_skips_the_segment_naming_file_and_field(tmp_path, field):
    """scan_segment() of that one file refuses it; the log's readers warn and read the
    other segments; a writer moves it aside, keeps it, and starts a new segment."""
    with LogWriter(tmp_path, 2, segment_bytes=1024, flush_interval=None) as w:
        for i in range(12):
            w.append(step_record(i))
    older = [r for p in list_segments(tmp_path, 2)[:-1] for r in scan_segment(p)[0]]
    path = list_segments(tmp_path, 2)[-1]
    raw = bytearray(path.read_bytes())
    if field == "rank":
        raw[:HEADER_SIZE] = encode_header(5, 1, 0)
    elif field == "seq":
        path = path.rename(path.with_name("000000000007.log"))
    elif field == "header":
        del raw[HEADER_SIZE - 1:]
    elif field == "header_size":
        raw[:HEADER_SIZE] = encode_header(2, 1, 0)
        raw[10] = 64
        import xxhash
        raw[44:48] = xxhash.xxh32_intdigest(bytes(raw[:44])).to_bytes(4, "little")
    else:
        raw[{"magic": 0, "version": 8, "checksum": 30}[field]] ^= 0x01
    if field != "seq":
        path.write_bytes(bytes(raw))
    with pytest.raises(CorruptLog) as e:
        scan_segment(path)
    assert str(path) in str(e.value) and f"'{field}'" in str(e.value)
    assert e.value.field == field
    for read in (lambda: list(read_records(tmp_path, 2)), lambda: last_record(tmp_path, 2),
                 lambda: find_step(tmp_path, 2, older[-1]["step"])):
        with pytest.warns(LogDamageWarning) as seen:
            read()
        assert any(str(path) in str(w.message) and f"'{field}'" in str(w.message)
                   for w in seen)
    with pytest.warns(LogDamageWarning):
        assert list(read_records(tmp_path, 2)) == older
    kept = path.read_bytes()
    with pytest.warns(LogDamageWarning, match="moved aside"):
        with LogWriter(tmp_path, 2, flush_interval=None) as w:
            w.append(step_record(99))
    aside = path.with_name(path.name + ".damaged-1")
    assert aside.read_bytes() == kept and not path.exists()
    assert list(read_records(tmp_path, 2)) == older + [step_record(99)]


class CountingFsync:
    """Injected fsync: counts calls, and fails the next ``fail`` of them."""

    def __init__(self):
        self.calls = self.fail = self.failed = 0
        self.lock = threading.Lock()

    def __call__(self, fd: int) -> None:
        with self.lock:
            self.calls += 1
            failing, self.fail = self.fail > 0, max(0, self.fail - 1)
            self.failed += failing
        if failing:
            raise OSError(5, "Input/output error")
        os.fsync(fd)


def count_flushes(w: LogWriter) -> list:
    """The flush thread's passes, each appended when it has finished (its fsync and
    sync mark done): what the tests wait on instead of sleeping."""
    done, flush = [], w._sync

    def counted(only_if_dirty):
        try:
            return flush(only_if_dirty)
        finally:
            done.append(only_if_dirty)

    w._sync = counted
    return done


def test_background_flush_fsyncs_only_what_was_written(tmp_path):
    fsync = CountingFsync()
    w = LogWriter(tmp_path, 0, flush_interval=0.005, fsync=fsync)
    flushes = count_flushes(w)
    w.append(step_record(0))  # creates the segment: file, directory fsyncs
    created = fsync.calls
    w.append(step_record(1))
    assert wait_for(lambda: fsync.calls > created)
    passes = len(flushes)
    assert wait_for(lambda: len(flushes) > passes)  # that flush has written its mark
    settled, passes = fsync.calls, len(flushes)
    assert wait_for(lambda: len(flushes) >= passes + 5)  # five passes, nothing written:
    assert fsync.calls == settled                         # not one more fsync
    w.append(step_record(2))
    assert wait_for(lambda: fsync.calls > settled)
    w.close()
    assert list(read_records(tmp_path, 0)) == [step_record(i) for i in range(3)]


def test_no_flush_thread_means_no_fsync_per_append(tmp_path):
    fsync = CountingFsync()
    w = LogWriter(tmp_path, 0, flush_interval=None, fsync=fsync)
    w.append(step_record(0))
    created = fsync.calls
    for i in range(1, 200):
        w.append(step_record(i))
    assert fsync.calls == created  # no thread: nothing runs between the appends and here
    w.sync()
    assert fsync.calls == created + 1
    w.close()


def test_failed_background_fsync_is_raised_once(tmp_path):
    fsync = CountingFsync()
    w = LogWriter(tmp_path, 0, flush_interval=0.02, fsync=fsync)
    w.append(step_record(0))
    fsync.fail = 1
    w.append(step_record(1))
    assert wait_for(lambda: w._error is not None)  # stored just after fsync raises
    assert fsync.failed == 1
    with pytest.raises(OSError, match="Input/output"):
        w.append(step_record(2))
    w.append(step_record(3))  # reported once (2 was refused); the writer keeps going
    w.close()
    assert [r["step"] for r in read_records(tmp_path, 0)] == [0, 1, 3]


def test_concurrent_appends_keep_every_record(tmp_path):
    w = LogWriter(tmp_path, 0, segment_bytes=8192, flush_interval=0.01)

    def worker(t):
        for i in range(300):
            w.append({"kind": "event", "thread": t, "i": i})

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    got = list(read_records(tmp_path, 0))
    assert len(got) == 1200
    for t in range(4):
        assert [r["i"] for r in got if r["thread"] == t] == list(range(300))


def test_replayed_steps_start_a_segment_and_the_newest_lineage_wins(tmp_path):
    with LogWriter(tmp_path, 0, flush_interval=None) as w:
        for i in range(100):
            w.append(step_record(i))
        w.append({"kind": "resume", "step": 50, "snapshot": 50})
        for i in range(51, 81):
            w.append(step_record(i, replay=True))
    assert len(list_segments(tmp_path, 0)) == 2
    assert find_step(tmp_path, 0, 60) == step_record(60, replay=True)
    assert find_step(tmp_path, 0, 90) == step_record(90)
    assert find_step(tmp_path, 0, 20) == step_record(20)
    assert find_step(tmp_path, 0, 500) is None
    assert find_last(tmp_path, 0, "resume")["step"] == 50
    with LogWriter(tmp_path, 0, flush_interval=None) as w:  # reopened: steps continue
        w.append(step_record(81, replay=True))
    assert len(list_segments(tmp_path, 0)) == 2
    assert last_record(tmp_path, 0) == step_record(81, replay=True)


def test_writer_rejects_bad_records(tmp_path):
    with LogWriter(tmp_path, 0, flush_interval=None) as w:
        for bad in ({"kind": "sync", "upto": 3}, {"kind": "step", "step": -1},
                    {"kind": "step", "step": "7"}):
            with pytest.raises(ValueError):
                w.append(bad)
        with pytest.raises(ValueError, match="exceeds"):
            w.append({"kind": "blob", "data": b"x" * (16 << 20)})
    assert list(read_records(tmp_path, 0)) == []


def test_recovery_planning_reads_a_bounded_number_of_bytes(long_log):
    """The log: steps 1..120,000, a commit every 1000 but the last, over three segments
    of 4 MiB or more, each more than the bounds below (tests/helpers.py, shared with
    test_recovery): no read here may read a whole segment, let alone the log."""
    log = long_log.path
    segments = list_segments(log, 0)
    assert len(segments) >= 3 and min(p.stat().st_size for p in segments) > 4 << 20
    last = LONG_LOG_STEPS
    stats = IOStats()
    assert last_record(log, 0, stats=stats) == logged_step(last)
    assert stats.bytes_read < 64 << 10, stats
    stats = IOStats()
    snap = find_last(log, 0, "snapshot", stats=stats)
    assert snap == logged_commit(last - 1000)
    stats2 = IOStats()
    assert find_last(log, 0, "snapshot", stats=stats2)["step"] == last - 1000
    assert stats.bytes_read < 1 << 20, stats
    # The first steps; steps 1.7 to 5 MiB into each segment (a scan from a segment's
    # start would break the bound), the ends of the first two among them; the last.
    for step in (1, 2, 4_095, 14_815, 42_000, 60_000, 84_000, 100_000, last - 2):
        stats = IOStats()
        assert find_step(log, 0, step, stats=stats) == logged_step(step)
        assert stats.bytes_read < 1 << 20, (step, stats)
    stats = IOStats()
    tail = read_tail(log, 0, 1000, stats=stats)
    assert [r["step"] for r in tail if r["kind"] == "step"][-1] == last
    assert len(tail) == 1000 and stats.bytes_read < 1 << 20


def test_torn_long_log_is_still_read_from_the_tail(long_log, tmp_path):
    last = list_segments(long_log.path, 0)[-1]
    torn = tmp_path / "log" / "rank-00000" / last.name
    torn.parent.mkdir(parents=True)
    shutil.copyfile(last, torn)
    with open(torn, "ab") as f:
        f.write(msgpack.packb({"kind": "step", "step": 1})[:5] + b"\x00" * 3000)
    stats = IOStats()
    assert last_record(tmp_path, 0, stats=stats)["step"] == LONG_LOG_STEPS
    assert stats.bytes_read < 64 << 10
    assert tail_report(tmp_path, 0).torn_at is not None


def test_sync_soon_flushes_without_waiting_for_the_tick(tmp_path):
    """snapshot() asks for a flush; the flush thread does it at once, not after 1 s."""
    import threading
    calls = []
    done = threading.Event()

    def counting_fsync(fd):
        calls.append(fd)
        done.set()

    with LogWriter(tmp_path, 0, flush_interval=3600, fsync=counting_fsync) as w:
        w.append({"kind": "step", "step": 1})
        done.clear()
        before = len(calls)
        w.sync_soon()
        assert done.wait(10), "sync_soon() did not wake the flush thread"
        assert len(calls) > before
