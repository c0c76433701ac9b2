// The page's client of the API: requests with the key in use, and an error reply as text.

import { apiKey } from "./keys.js";

export function headers(extra = {}) {
  const all = { ...extra };
  const key = apiKey();
  if (key) all.Authorization = `Bearer ${key}`;
  return all;
}

export async function api(path, options = {}) {
  const init = { ...options, headers: headers(options.headers) };
  if (options.body !== undefined) init.headers["Content-Type"] = "application/json";
  return fetch(path, init);
}

export async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error) {
      const problems = (body.error.problems || []).map((p) => `${p.path || ""} ${p.message}`);
      return [body.error.message, ...problems].join("\n");
    }
  } catch {
    // not JSON: fall through to the status line
  }
  return `${response.status} ${response.statusText}`;
}

/** `path` with a stream token, for what cannot send a header (EventSource, a link). */
export function withToken(path, token) {
  return token ? `${path}?token=${encodeURIComponent(token)}` : path;
}
