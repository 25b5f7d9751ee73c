"""Writing a download's blocks to disk: every byte of a block even after a short write, writeback started
block by block so the disk works while the network does, and a folder's entry made durable. Plain Python."""
import ctypes
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


try:
    _SYNC_FILE_RANGE = ctypes.CDLL(None, use_errno=True).sync_file_range
    _SYNC_FILE_RANGE.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (OSError, AttributeError):  # not Linux
    _SYNC_FILE_RANGE = None
SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    # Left alone, the kernel keeps a whole model in dirty pages and writes it all during the final fsync
    # (seconds per GB); starting writeback block by block overlaps the disk with the network. Advisory.
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE)


def write_all(fd: int, block: list[bytes]) -> None:
    written, total = os.writev(fd, block), sum(map(len, block))
    if written < total:  # a short write, e.g. on a nearly full disk
        rest = memoryview(b"".join(block))[written:]
        while rest:
            rest = rest[os.write(fd, rest):]
