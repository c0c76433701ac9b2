// The run panel's head and foot: the status badge, notices, and the outcome.

import { $, el, show } from "./dom.js";
import { renderValue } from "./values.js";

/** The run's status on its badge; `label` says more (a queued run's place in line). */
export function setStatus(run, status, label = status) {
  run.status = status;
  const badge = $("run-status");
  badge.textContent = label;
  badge.dataset.status = status;
  delete badge.dataset.decision;
  show($("cancel"), status === "queued" || status === "running" || status === "paused");
  $("cancel").disabled = false;
}

export function setDuplicates(run) {
  $("run").dataset.duplicates = String(run.duplicates);
}

export function notice(text, kind = "warning") {
  $("notices").append(el("p", { class: `notice ${kind}`, text, role: "status" }));
}

/** The outcome of a finished run: its output, or why it failed or was cancelled. */
export function showResult(run, status, output, error) {
  const body = $("result-body");
  if (status === "completed") {
    $("result-title").textContent = "Output";
    body.replaceChildren(renderValue(run, output));
  } else {
    $("result-title").textContent = status === "failed" ? "Failed" : "Cancelled";
    const parts = [error && error.code, error && error.message, error && error.blockId && `(block ${error.blockId})`];
    body.replaceChildren(el("p", { class: "error", text: parts.filter(Boolean).join(": ") }));
  }
  show($("result"), true);
}

/** The run's input (execution:started's, or the snapshot's), with "Run again". */
export function showInput(run, input) {
  run.input = input === undefined ? null : input;
  run.inputKnown = true;
  const text = JSON.stringify(run.input);
  $("run-input-preview").textContent = text.length > 80 ? `${text.slice(0, 80)}…` : text;
  $("run-input").textContent = JSON.stringify(run.input, null, 2);
  show($("run-input-box"), true);
  show($("run-again-box"), true);
}
