"""The server's process concerns, one place: ``serve`` (the work behind ``featcache serve``:
lmdeploy's api_server with featcache installed), ``report`` (each response's per-request report on
the wire), ``shutdown`` (a bounded shutdown, and a process's last line on its cache's writes: the
server's and each model process's).

Nothing is imported here, so that a model process can take ``shutdown`` without the server's
imports (lmdeploy's api_server, the integration's facade)."""
