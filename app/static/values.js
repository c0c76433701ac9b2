// Values in events: inline JSON, or a reference to a large value kept by the server,
// shown as its preview with a button that reads (at most a part of) the full value.

import { errorText, headers, withToken } from "./api.js";
import { el, show } from "./dom.js";
import { formatBytes } from "./format.js";

const SHOWN_VALUE_BYTES = 1024 * 1024; // a full value larger than this is shown cut short

function isRef(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value) && value.$ref === "value";
}

function containsRef(value) {
  if (isRef(value)) return true;
  if (value !== null && typeof value === "object") return Object.values(value).some(containsRef);
  return false;
}

export function renderValue(run, value) {
  if (isRef(value)) return renderRef(run, value);
  if (!containsRef(value)) return el("pre", { class: "json", text: JSON.stringify(value, null, 2) });
  // A container with refs somewhere inside: lay it out key by key so each ref gets a button.
  const tree = el("div", { class: "tree" });
  for (const [key, item] of Object.entries(value)) {
    const label = Array.isArray(value) ? `[${key}]` : key;
    tree.append(el("div", { class: "member" }, el("span", { class: "key", text: label }), renderValue(run, item)));
  }
  return tree;
}

function previewText(ref) {
  if (ref.kind === "string") return JSON.stringify(ref.preview) + (ref.size > 258 ? " …" : "");
  if (ref.kind === "array") return `an array of ${ref.preview} items`;
  if (Array.isArray(ref.preview)) return `{ ${ref.preview.join(", ")}${ref.preview.length >= 20 ? ", …" : ""} }`;
  return JSON.stringify(ref.preview);
}

function renderRef(run, ref) {
  const url = withToken(`/api/executions/${run.id}/values/${encodeURIComponent(ref.id)}`, run.token);
  const full = el("div", { class: "full", hidden: true });
  const available = ref.available !== false;
  const open = el("button", {
    type: "button",
    class: "open-value",
    text: available ? "Open full value" : "Full value not available",
    disabled: !available,
  });
  open.addEventListener("click", () => openValue(url, ref, open, full));
  return el("div", { class: "ref", "data-value-id": ref.id },
    el("div", { class: "ref-head" },
      el("span", { class: "badge", text: `large ${ref.kind}` }),
      el("span", { class: "hint", text: formatBytes(ref.size) }),
      open),
    el("pre", { class: "preview", text: previewText(ref) }),
    full);
}

async function readSome(response, limit) {
  // Read at most `limit` bytes, so a value of hundreds of MiB never lands in the page.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let text = "";
  let read = 0;
  while (read < limit) {
    const { done, value } = await reader.read();
    if (done) return { text: text + decoder.decode(), complete: true };
    read += value.byteLength;
    text += decoder.decode(value, { stream: true });
  }
  await reader.cancel();
  return { text, complete: false };
}

async function openValue(url, ref, button, target) {
  button.disabled = true;
  button.textContent = "Loading…";
  try {
    const response = await fetch(url, { headers: headers() });
    if (!response.ok) throw new Error(await errorText(response));
    const { text, complete } = await readSome(response, SHOWN_VALUE_BYTES);
    let shown = text;
    if (complete) {
      try {
        shown = JSON.stringify(JSON.parse(text), null, 2);
      } catch {
        // keep the text as it came
      }
    }
    const parts = [el("pre", { class: "json full-value", text: shown })];
    if (!complete) {
      parts.unshift(el("p", { class: "hint", text: `Showing the first ${formatBytes(SHOWN_VALUE_BYTES)} of ${formatBytes(ref.size)}.` }));
    }
    parts.push(el("a", { href: url, download: `${ref.id}.json`, text: "Download" }));
    target.replaceChildren(...parts);
    show(target, true);
    button.textContent = "Full value shown";
  } catch (error) {
    target.replaceChildren(el("p", { class: "error", text: `Cannot open the value: ${error.message}` }));
    show(target, true);
    button.disabled = false;
    button.textContent = "Open full value";
  }
}
