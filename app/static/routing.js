// The URL hash names the execution being watched (`#ex_…` or `#ex_…&token=…`), so a
// reload or a link re-attaches to it.

export function hashOf(executionId, token) {
  return token ? `${executionId}&token=${encodeURIComponent(token)}` : executionId;
}

/** The hash's execution and token, or null when it names none. */
export function parseHash() {
  const raw = location.hash.slice(1);
  if (!raw) return null;
  const [executionId, ...rest] = raw.split("&");
  const params = new URLSearchParams(rest.join("&"));
  return executionId ? { executionId, token: params.get("token") } : null;
}
