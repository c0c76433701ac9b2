// Sizes and durations as the page writes them.

export function formatBytes(size) {
  if (size < 1024) return `${size} B`;
  if (size < 1024 * 1024) return `${(size / 1024).toFixed(1)} KiB`;
  return `${(size / 1024 / 1024).toFixed(1)} MiB`;
}

export function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

/** A queued run's place: "queued, 3 ahead" (or just "queued" when the place is not known). */
export function queuedLabel(ahead) {
  return Number.isInteger(ahead) ? `queued, ${ahead} ahead` : "queued";
}
