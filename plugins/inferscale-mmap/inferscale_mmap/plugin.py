from inferscale import hookimpl
from inferscale_mmap.store import MappedFileStore


@hookimpl
def register_kv_stores(register):
    register(MappedFileStore)
