"""The host's RAM, total and free now, as the operating system reports it.

Without torch: a Ray task that only measures it starts in a fresh worker process, where importing
torch would cost seconds.
"""

import os


def host_ram_bytes() -> tuple[int, int]:
    """(total, free) bytes of this machine's RAM; free leaves out the page cache."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def available_host_bytes() -> int:
    """The host RAM free now (the page cache not counted)."""
    return host_ram_bytes()[1]
