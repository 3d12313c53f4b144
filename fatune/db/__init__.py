"""The tuned DB: entries keyed by GPU, installation and call (keys), validated (entry), kept in SQLite files (store).

It imports from fatune.kernel (specs, configs, the kernel hashes an entry stores) and fatune.settings; the
runtime and the search import it.
"""

from fatune.db.entry import MAX_FLOPS_PER_S, MIN_TIME_MS, DBError, Entry, InvalidEntry, is_stale
from fatune.db.keys import (
    INSTALLATION_COLUMNS,
    KEY_COLUMNS,
    CallKey,
    call_key,
    is_decode,
    key_columns,
    mask_variants,
    problem_key,
    seqlen_bucket,
    variant_fields,
)
from fatune.db.store import (
    SCHEMA_VERSION,
    TunedDB,
    bucket_distance,
    check_readable,
    check_regular,
    check_writable,
    default_path,
    export_entries,
    import_entries,
    label,
    nearest,
    read_entries,
    shipped_dbs,
)

__all__ = ["INSTALLATION_COLUMNS", "KEY_COLUMNS", "MAX_FLOPS_PER_S", "MIN_TIME_MS", "SCHEMA_VERSION", "CallKey", "DBError", "Entry",
           "InvalidEntry", "TunedDB", "bucket_distance", "call_key", "check_readable", "check_regular", "check_writable",
           "default_path", "export_entries", "import_entries", "is_decode", "is_stale", "key_columns", "label",
           "mask_variants", "nearest", "problem_key", "read_entries", "seqlen_bucket", "shipped_dbs", "variant_fields"]
