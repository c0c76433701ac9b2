// Flowcast's web page: start a workflow, watch its events over SSE, answer pauses.
//
// Plain JavaScript with no build step. The execution being watched lives in the URL hash
// (`#ex_…` or `#ex_…&token=…`), so a reload re-attaches from cursor 0 and rebuilds the
// page from the replayed events; EventSource's own reconnects send Last-Event-ID.
"use strict";

const TERMINAL = new Set(["execution:completed", "execution:failed", "execution:cancelled"]);
const EVENT_TYPES = [
  "execution:started", "block:started", "block:chunk", "block:completed", "block:failed",
  "block:skipped", "execution:paused", "execution:resumed", "execution:recovered", ...TERMINAL,
];
const KEY_STORAGE = "flowcast.apiKey";
const SHOWN_VALUE_BYTES = 1024 * 1024; // a full value larger than this is shown cut short

const $ = (id) => document.getElementById(id);

const page = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  run: null, // the execution being watched; see attach()
  graph: null, // the workflow drawn as a graph (graph.js), fed every event of the run
};

// ------------------------------------------------------------------ small helpers

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

function show(node, visible) {
  node.hidden = !visible;
}

function formatBytes(size) {
  if (size < 1024) return `${size} B`;
  if (size < 1024 * 1024) return `${(size / 1024).toFixed(1)} KiB`;
  return `${(size / 1024 / 1024).toFixed(1)} MiB`;
}

function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function headers(extra = {}) {
  const all = { ...extra };
  if (page.key) all.Authorization = `Bearer ${page.key}`;
  return all;
}

async function api(path, options = {}) {
  const init = { ...options, headers: headers(options.headers) };
  if (options.body !== undefined) init.headers["Content-Type"] = "application/json";
  return fetch(path, init);
}

async function errorText(response) {
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

function withToken(path, token) {
  return token ? `${path}?token=${encodeURIComponent(token)}` : path;
}

// ------------------------------------------------------------------ API key

function renderKey() {
  $("api-key").value = "";
  $("api-key").placeholder = page.key ? "in use in this tab" : "if the server needs one";
  show($("key-forget"), Boolean(page.key));
}

function setKey(key) {
  page.key = key;
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  renderKey();
  loadWorkflows();
  if (page.graph) page.graph.reload();
  document.dispatchEvent(new CustomEvent("flowcast:key"));
}

// ------------------------------------------------------------------ workflows

async function loadWorkflows() {
  const select = $("workflow");
  const problem = $("launch-error");
  show(problem, false);
  let response;
  try {
    response = await api("/api/workflows");
  } catch (error) {
    problem.textContent = `Cannot reach the server: ${error.message}`;
    show(problem, true);
    return;
  }
  if (response.status === 401) {
    problem.textContent = "This server needs an API key: enter it above.";
    show(problem, true);
    select.replaceChildren();
    $("api-key").focus();
    return;
  }
  if (!response.ok) {
    problem.textContent = await errorText(response);
    show(problem, true);
    return;
  }
  const { workflows } = await response.json();
  const chosen = select.value || (page.run && page.run.workflowId);
  select.replaceChildren(
    ...workflows.map((wf) =>
      el("option", { value: wf.id, text: wf.name ? `${wf.name} (${wf.id})` : wf.id }),
    ),
  );
  select._workflows = new Map(workflows.map((wf) => [wf.id, wf]));
  if (chosen && select._workflows.has(chosen)) select.value = chosen;
  describeWorkflow();
}

function describeWorkflow() {
  const select = $("workflow");
  const wf = select._workflows && select._workflows.get(select.value);
  $("workflow-description").textContent = wf
    ? `${wf.description || ""} ${wf.blocks} blocks, from ${wf.source}.`.trim()
    : "";
}

async function start(event) {
  event.preventDefault();
  const problem = $("launch-error");
  show(problem, false);
  let input;
  try {
    input = JSON.parse($("input").value || "null");
  } catch (error) {
    problem.textContent = `The input is not valid JSON: ${error.message}`;
    show(problem, true);
    return;
  }
  const workflowId = $("workflow").value;
  if (!workflowId) return;
  $("start").disabled = true;
  try {
    const response = await api(`/api/workflows/${encodeURIComponent(workflowId)}/execute`, {
      method: "POST",
      body: JSON.stringify({ input }),
    });
    if (response.status !== 202) {
      problem.textContent = await errorText(response);
      show(problem, true);
      return;
    }
    const started = await response.json();
    // The token only matters when keys are on; without a key it is left out of the URL.
    const token = page.key ? started.streamToken : null;
    history.pushState(null, "", `#${hashOf(started.executionId, token)}`);
    attach(started.executionId, token);
  } catch (error) {
    problem.textContent = `Cannot start: ${error.message}`;
    show(problem, true);
  } finally {
    $("start").disabled = false;
  }
}

// ------------------------------------------------------------------ the hash

function hashOf(executionId, token) {
  return token ? `${executionId}&token=${encodeURIComponent(token)}` : executionId;
}

function parseHash() {
  const raw = location.hash.slice(1);
  if (!raw) return null;
  const [executionId, ...rest] = raw.split("&");
  const params = new URLSearchParams(rest.join("&"));
  return executionId ? { executionId, token: params.get("token") } : null;
}

function followHash() {
  const target = parseHash();
  if (!target) return;
  if (page.run && page.run.id === target.executionId) return;
  attach(target.executionId, target.token);
}

// ------------------------------------------------------------------ watching a run

function attach(executionId, token) {
  if (page.run && page.run.source) page.run.source.close();
  const run = {
    id: executionId,
    token,
    source: null,
    seen: new Set(),
    duplicates: 0,
    blocks: new Map(),
    startedAt: null,
    status: "connecting",
    finished: false,
    workflowId: null,
    pause: null,
  };
  page.run = run;

  $("run-id").textContent = executionId;
  $("run-workflow").textContent = "";
  $("run-duration").textContent = "";
  $("timeline").replaceChildren();
  $("notices").replaceChildren();
  $("events").replaceChildren();
  $("log-count").textContent = "0";
  $("result-body").replaceChildren();
  show($("result"), false);
  page.graph.reset();
  hidePause();
  setStatus(run, "connecting");
  setDuplicates(run);
  show($("run"), true);

  const source = new EventSource(withToken(`/api/executions/${executionId}/stream`, token));
  run.source = source;
  for (const type of EVENT_TYPES) {
    source.addEventListener(type, (message) => onEvent(run, message));
  }
  source.addEventListener("replay:gap", (message) => onGap(run, JSON.parse(message.data)));
  source.onopen = () => {
    if (page.run === run) $("run-connection").textContent = "live";
  };
  source.onerror = () => {
    if (page.run !== run || run.finished) return;
    if (source.readyState === EventSource.CONNECTING) {
      $("run-connection").textContent = "reconnecting…";
      return;
    }
    // CLOSED: a 204 (nothing more to send), a 401/404, or the server went away for good.
    $("run-connection").textContent = "stream closed";
    explainClosed(run);
  };
}

function detach(run) {
  run.finished = true;
  if (run.source) run.source.close();
  if (page.run === run) $("run-connection").textContent = "";
}

async function explainClosed(run) {
  const response = await api(`/api/executions/${run.id}`).catch(() => null);
  if (page.run !== run) return;
  if (!response || !response.ok) {
    const why = response ? await errorText(response) : "the server cannot be reached";
    notice(`The stream closed and the execution cannot be read: ${why}`, "error");
    return;
  }
  const snapshot = await response.json();
  setStatus(run, snapshot.status);
  if (["completed", "failed", "cancelled"].includes(snapshot.status)) {
    showResult(snapshot.status, snapshot.output, snapshot.error);
    detach(run);
  }
}

function setStatus(run, status) {
  run.status = status;
  const badge = $("run-status");
  badge.textContent = status;
  badge.dataset.status = status;
  show($("cancel"), status === "running" || status === "paused");
  $("cancel").disabled = false;
}

function setDuplicates(run) {
  $("run").dataset.duplicates = String(run.duplicates);
}

function notice(text, kind = "warning") {
  $("notices").append(el("p", { class: `notice ${kind}`, text, role: "status" }));
}

function onGap(run, gap) {
  if (page.run !== run) return;
  const missing = Math.max(0, gap.resumeAt - gap.after - 1);
  const what = missing === 1 ? "1 event was" : `${missing} events were`;
  notice(
    `${what} not retained (${gap.reason}): events ${gap.after + 1} to ${gap.resumeAt - 1} ` +
      "cannot be shown; what follows starts at event " + gap.resumeAt + ".",
  );
}

function onEvent(run, message) {
  if (page.run !== run) return;
  const event = JSON.parse(message.data);
  // The server sends every event once; this is only a safety net.
  if (run.seen.has(event.id)) {
    run.duplicates += 1;
    setDuplicates(run);
    return;
  }
  run.seen.add(event.id);
  logEvent(event);
  apply(run, event);
  page.graph.apply(event);
  if (TERMINAL.has(event.type)) detach(run);
}

function logEvent(event) {
  const data = event.data || {};
  let detail = data.blockId ? ` ${data.blockId}` : "";
  if (event.type === "execution:recovered") detail = ` ${data.reason}`;
  $("events").append(
    el("li", { "data-event-id": String(event.id), "data-type": event.type },
      el("span", { class: "id", text: `#${event.id}` }),
      el("span", { class: "type", text: event.type }),
      el("span", { class: "detail", text: detail })),
  );
  $("log-count").textContent = String($("events").childElementCount);
}

function offsetOf(run, ts) {
  if (run.startedAt === null) return "";
  return `+${formatMs(Date.parse(ts) - run.startedAt)}`;
}

function blockRow(run, blockId, ts) {
  let row = run.blocks.get(blockId);
  if (row) return row;
  const node = el("li", { class: "block", "data-block-id": blockId });
  const status = el("span", { class: "status", "data-status": "pending", text: "pending" });
  const name = el("span", { class: "name", text: blockId });
  const kind = el("span", { class: "kind" });
  const at = el("span", { class: "at", text: offsetOf(run, ts) });
  const attempt = el("span", { class: "attempt" });
  const duration = el("span", { class: "duration" });
  const chunks = el("pre", { class: "chunks", hidden: true });
  const output = el("div", { class: "output", hidden: true });
  const error = el("p", { class: "error", hidden: true });
  node.append(
    el("div", { class: "row-head" }, status, name, kind, attempt, el("span", { class: "spacer" }),
      at, duration),
    chunks, output, error,
  );
  row = { node, status, kind, attempt, duration, chunks, output, error, startedTs: null };
  run.blocks.set(blockId, row);
  $("timeline").append(node);
  return row;
}

function setBlockStatus(row, status) {
  row.status.textContent = status;
  row.status.dataset.status = status;
  row.node.dataset.status = status;
}

function apply(run, event) {
  const data = event.data || {};
  switch (event.type) {
    case "execution:started": {
      run.startedAt = Date.parse(event.ts);
      run.workflowId = event.workflowId;
      $("run-workflow").textContent = `workflow ${event.workflowId}`;
      const select = $("workflow");
      if (select._workflows && select._workflows.has(event.workflowId)) {
        select.value = event.workflowId;
        describeWorkflow();
      }
      setStatus(run, "running");
      break;
    }
    case "block:started": {
      const row = blockRow(run, data.blockId, event.ts);
      row.startedTs = Date.parse(event.ts);
      row.kind.textContent = data.blockType || "";
      row.attempt.textContent = data.attempt > 1 ? `attempt ${data.attempt}` : "";
      // A block that runs again (a retry, a re-run after execution:recovered) streams
      // from the start: show this run's text, not the runs' texts joined.
      row.chunks.textContent = "";
      show(row.chunks, false);
      show(row.error, false);
      row.duration.textContent = "";
      setBlockStatus(row, "started");
      break;
    }
    case "block:chunk": {
      const row = blockRow(run, data.blockId, event.ts);
      row.chunks.textContent += data.text;
      show(row.chunks, true);
      setBlockStatus(row, "running");
      break;
    }
    case "block:completed": {
      const row = blockRow(run, data.blockId, event.ts);
      setBlockStatus(row, "completed");
      row.duration.textContent = formatMs(data.durationMs);
      row.output.replaceChildren(renderValue(run, data.output));
      show(row.output, true);
      break;
    }
    case "block:failed": {
      const row = blockRow(run, data.blockId, event.ts);
      setBlockStatus(row, data.willRetry ? "retrying" : "failed");
      row.attempt.textContent = `attempt ${data.attempt}`;
      if (row.startedTs !== null) row.duration.textContent = formatMs(Date.parse(event.ts) - row.startedTs);
      const error = data.error || {};
      row.error.textContent = `${error.code || "error"}: ${error.message || ""}`;
      show(row.error, true);
      break;
    }
    case "block:skipped": {
      const row = blockRow(run, data.blockId, event.ts);
      setBlockStatus(row, "skipped");
      row.error.textContent = data.reason || "";
      row.error.className = "hint";
      show(row.error, Boolean(data.reason));
      break;
    }
    case "execution:paused": {
      const row = blockRow(run, data.blockId, event.ts);
      setBlockStatus(row, "waiting");
      setStatus(run, "paused");
      showPause(run, data);
      break;
    }
    case "execution:resumed": {
      const row = run.blocks.get(data.blockId);
      if (row) setBlockStatus(row, "resumed");
      hidePause();
      setStatus(run, "running");
      break;
    }
    case "execution:recovered": {
      // Not an ending: another process carries the execution on from its checkpoint.
      for (const blockId of data.rerun || []) {
        const row = run.blocks.get(blockId);
        if (row) setBlockStatus(row, "re-run");
      }
      const rerun = (data.rerun || []).length;
      const kept = (data.completed || []).length;
      notice(
        `Recovered (${data.reason}): ${rerun === 1 ? "1 block" : `${rerun} blocks`} re-run, ` +
          `${kept} kept from the checkpoint.`,
        "info",
      );
      setStatus(run, "running");
      break;
    }
    case "execution:completed":
      setStatus(run, "completed");
      $("run-duration").textContent = `· finished in ${formatMs(data.durationMs)}`;
      showResult("completed", data.output, null);
      break;
    case "execution:failed":
      setStatus(run, "failed");
      showResult("failed", null, data.error);
      break;
    case "execution:cancelled":
      setStatus(run, "cancelled");
      hidePause();
      showResult("cancelled", null, { message: data.reason || "cancelled" });
      break;
    default:
      break;
  }
}

function showResult(status, output, error) {
  const body = $("result-body");
  if (status === "completed") {
    $("result-title").textContent = "Output";
    body.replaceChildren(renderValue(page.run, output));
  } else {
    $("result-title").textContent = status === "failed" ? "Failed" : "Cancelled";
    const parts = [error && error.code, error && error.message, error && error.blockId && `(block ${error.blockId})`];
    body.replaceChildren(el("p", { class: "error", text: parts.filter(Boolean).join(": ") }));
  }
  show($("result"), true);
}

// ------------------------------------------------------------------ values and refs

function isRef(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value) && value.$ref === "value";
}

function containsRef(value) {
  if (isRef(value)) return true;
  if (value !== null && typeof value === "object") return Object.values(value).some(containsRef);
  return false;
}

function renderValue(run, value) {
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

// ------------------------------------------------------------------ pauses

// The property types a generated form handles; anything else gets a JSON textarea.
function simpleProperty(schema) {
  if (!schema || typeof schema !== "object") return false;
  if (Array.isArray(schema.enum)) return schema.enum.every((v) => ["string", "number", "boolean"].includes(typeof v));
  return ["boolean", "string", "number", "integer"].includes(schema.type);
}

function formable(schema) {
  return (
    schema && schema.type === "object" && schema.properties && typeof schema.properties === "object" &&
    Object.values(schema.properties).every(simpleProperty)
  );
}

function hasApproved(schema) {
  return formable(schema) && schema.properties.approved && schema.properties.approved.type === "boolean";
}

function fieldFor(name, schema, required) {
  const id = `field-${name}`;
  const title = schema.title || name;
  const label = el("label", { htmlFor: id },
    title, required ? el("span", { class: "required", title: "required", text: " *" }) : null);
  let input;
  if (Array.isArray(schema.enum)) {
    input = el("select", { id, name });
    if (!required) input.append(el("option", { value: "", text: "—" }));
    schema.enum.forEach((value, index) => input.append(el("option", { value: String(index), text: String(value) })));
    if (schema.default !== undefined) input.value = String(schema.enum.indexOf(schema.default));
  } else if (schema.type === "boolean") {
    input = el("input", { id, name, type: "checkbox", checked: schema.default === true });
  } else if (schema.type === "number" || schema.type === "integer") {
    input = el("input", { id, name, type: "number", step: schema.type === "integer" ? "1" : "any" });
    if (schema.default !== undefined) input.value = String(schema.default);
  } else {
    input = el("input", { id, name, type: "text" });
    if (schema.default !== undefined) input.value = String(schema.default);
  }
  input.required = required && schema.type !== "boolean";
  const help = schema.description ? el("span", { class: "hint", text: schema.description }) : null;
  const wrap = el("div", { class: `field field-${schema.type || "enum"}`, "data-field": name });
  const parts = schema.type === "boolean" ? [input, label, help] : [label, input, help];
  wrap.append(...parts.filter(Boolean));
  return { wrap, read: () => readField(input, schema) };
}

function readField(input, schema) {
  if (Array.isArray(schema.enum)) return input.value === "" ? undefined : schema.enum[Number(input.value)];
  if (schema.type === "boolean") return input.checked;
  if (input.value === "") return undefined;
  // A non-integer typed for an integer is sent as it is, for the schema check to refuse.
  if (schema.type === "integer" || schema.type === "number") return Number(input.value);
  return input.value;
}

function showPause(run, pause) {
  run.pause = pause;
  const schema = pause.schema || {};
  $("pause-block").textContent = `(block ${pause.blockId})`;
  $("pause-prompt").textContent = pause.prompt || "";
  show($("pause-error"), false);
  const fields = $("pause-fields");
  fields.replaceChildren();
  const approval = hasApproved(schema);
  let read;
  if (formable(schema)) {
    const required = new Set(schema.required || []);
    const readers = [];
    for (const [name, property] of Object.entries(schema.properties)) {
      // With a boolean `approved`, the Approve and Reject buttons are its answer.
      if (approval && name === "approved") continue;
      const field = fieldFor(name, property, required.has(name));
      fields.append(field.wrap);
      readers.push([name, field.read]);
    }
    read = () => {
      const value = {};
      for (const [name, readOne] of readers) {
        const got = readOne();
        if (got !== undefined) value[name] = got;
      }
      return value;
    };
  } else {
    const area = el("textarea", { id: "field-json", rows: 6, spellcheck: false, text: "{}" });
    fields.append(
      el("div", { class: "field field-json" },
        el("label", { htmlFor: "field-json", text: "Answer (JSON)" }), area,
        el("pre", { class: "hint schema", text: `schema: ${JSON.stringify(schema)}` })),
    );
    read = () => JSON.parse(area.value);
  }
  $("pause-submit").textContent = approval ? "Approve" : "Submit";
  show($("pause-reject"), approval);
  run.readPause = (approved) => {
    const value = read();
    if (approval) value.approved = approved;
    return value;
  };
  setPauseBusy(false);
  show($("pause"), true);
}

function hidePause() {
  show($("pause"), false);
  if (page.run) page.run.pause = null;
}

function setPauseBusy(busy) {
  $("pause-submit").disabled = busy;
  $("pause-reject").disabled = busy;
}

async function resume(approved) {
  const run = page.run;
  if (!run || !run.pause) return;
  const problem = $("pause-error");
  show(problem, false);
  let input;
  try {
    input = run.readPause(approved);
  } catch (error) {
    problem.textContent = `The answer is not valid JSON: ${error.message}`;
    show(problem, true);
    return;
  }
  setPauseBusy(true);
  try {
    const response = await api(`/api/executions/${run.id}/resume`, {
      method: "POST",
      body: JSON.stringify({ blockId: run.pause.blockId, input }),
    });
    if (response.status !== 202) {
      problem.textContent = await errorText(response);
      show(problem, true);
      setPauseBusy(false);
    }
    // On 202 the form goes away when execution:resumed arrives on the stream.
  } catch (error) {
    problem.textContent = `Cannot resume: ${error.message}`;
    show(problem, true);
    setPauseBusy(false);
  }
}

async function cancel() {
  const run = page.run;
  if (!run) return;
  $("cancel").disabled = true;
  const response = await api(`/api/executions/${run.id}/cancel`, { method: "POST" }).catch((error) => {
    notice(`Cannot cancel: ${error.message}`, "error");
    return null;
  });
  if (response && response.status !== 202) notice(await errorText(response), "error");
  // The stream brings execution:cancelled, which settles the status.
}

// ------------------------------------------------------------------ the graph's hooks

async function loadDefinition(workflowId) {
  const response = await api(`/api/workflows/${encodeURIComponent(workflowId)}`);
  if (response.status === 401) throw new Error("the workflow can be read with the API key only.");
  if (!response.ok) throw new Error(await errorText(response));
  return response.json();
}

function showBlockRow(blockId) {
  const row = page.run && page.run.blocks.get(blockId);
  if (!row) return false;
  for (const other of $("timeline").querySelectorAll(".block.highlighted")) other.classList.remove("highlighted");
  row.node.classList.add("highlighted");
  row.node.scrollIntoView({ behavior: "smooth", block: "center" });
  return true;
}

// ------------------------------------------------------------------ for the other modules

// list.js: the key in use (it fires "flowcast:key" on the document when it changes), and
// the hash that attaches to an execution (a link to it survives a reload).
window.flowcast = Object.assign(window.flowcast || {}, {
  apiKey: () => page.key,
  hashOf,
});

// ------------------------------------------------------------------ wiring

document.addEventListener("DOMContentLoaded", () => {
  page.graph = new FlowGraph($("graph"), { load: loadDefinition, select: showBlockRow });
  renderKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const typed = $("api-key").value.trim();
    if (typed) setKey(typed);
  });
  $("key-forget").addEventListener("click", () => setKey(""));
  $("workflow").addEventListener("change", describeWorkflow);
  $("start-form").addEventListener("submit", start);
  $("pause").addEventListener("submit", (event) => {
    event.preventDefault();
    resume(true);
  });
  $("pause-reject").addEventListener("click", () => resume(false));
  $("cancel").addEventListener("click", cancel);
  window.addEventListener("hashchange", followHash);
  loadWorkflows();
  followHash();
});
