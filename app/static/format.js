// Sizes, durations and answers as the page writes them.

export function formatBytes(size) {
  if (size < 1024) return `${size} B`;
  if (size < 1024 * 1024) return `${(size / 1024).toFixed(1)} KiB`;
  return `${(size / 1024 / 1024).toFixed(1)} MiB`;
}

export function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

const pad = (number) => String(number).padStart(2, "0");

const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

/** "Dec 2 21:35:15" (with the year when it is not this year's: "Dec 31 2025 23:59:01"),
in local time: the list's and the run's start, always dated. */
export function formatDateTime(iso) {
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return "";
  const year = date.getFullYear() === new Date().getFullYear() ? "" : ` ${date.getFullYear()}`;
  const day = `${MONTHS[date.getMonth()]} ${date.getDate()}${year}`;
  return `${day} ${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

/**
 * A run's duration, written the same in the list and the run panel: finished runs to the
 * tenth of a second ("7.6 s"), running ones (`ticking`) in whole seconds as they tick.
 */
export function formatDuration(ms, ticking = false) {
  const span = Math.max(0, ms);
  if (span < 1000 && !ticking) return `${Math.round(span)} ms`;
  const seconds = Math.floor(span / 1000);
  if (seconds < 60) return ticking ? `${seconds} s` : `${(span / 1000).toFixed(1)} s`;
  const days = Math.floor(seconds / 86400);
  const hours = Math.floor((seconds % 86400) / 3600);
  const minutes = Math.floor((seconds % 3600) / 60);
  if (days) return `${days} d ${hours} h`;
  if (hours) return `${hours} h ${pad(minutes)} min`;
  return `${minutes} min ${pad(seconds % 60)} s`;
}

/** A queued run's place: "queued, 3 ahead" (or just "queued" when the place is not known). */
export function queuedLabel(ahead) {
  return Number.isInteger(ahead) ? `queued, ${ahead} ahead` : "queued";
}

/**
 * What a pause's answer (`execution:resumed`'s `input`) decided: `{decision, note}`, with
 * `decision` "approved" or "rejected" when the answer has a boolean `approved` (the
 * approval schema's convention, SPEC §2; the page's Approve and Reject send it), else
 * "answered"; `note` is its `note` when it gave one.
 */
export function decisionOf(answer) {
  const given = answer && typeof answer === "object" && !Array.isArray(answer) ? answer : {};
  let decision = "answered";
  if (given.approved === true) decision = "approved";
  if (given.approved === false) decision = "rejected";
  const note = typeof given.note === "string" && given.note ? given.note : "";
  return { decision, note };
}

/** "rejected: “too much”", "approved", "answered". */
export function decisionText({ decision, note }) {
  return note ? `${decision}: “${note}”` : decision;
}
