"""A throwaway HTTP server on 127.0.0.1 in a thread, for download tests."""

from __future__ import annotations

import http.server
import threading
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def serve(handler: Callable[..., http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve with ``handler`` on a free port; yields the base URL (no trailing slash)."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
