// Flowcast's web page: start a workflow, watch its events over SSE, answer pauses.
//
// Plain JavaScript modules with no build step; this one wires them to the page:
// keys.js (the API key), api.js (requests), launch.js (workflows and the start form),
// watch.js (the execution being watched: its stream, fed to events.js, timeline.js,
// panel.js, pause.js and the graph), values.js (large values), forms.js (answer forms).
// The execution being watched lives in the URL hash (routing.js), so a reload
// re-attaches to it. The list of recent executions is list.js, a module of its own.

import { $ } from "./dom.js";
import { FlowGraph } from "./graph.js";
import { renderKey, setKey } from "./keys.js";
import { describeWorkflow, fillForm, loadDefinition, loadWorkflows, previewOn, start } from "./launch.js";
import { resume } from "./pause.js";
import { hashOf, parseHash } from "./routing.js";
import { attach, cancel, drawOn, reveal, showBlockRow, watched } from "./watch.js";

function reloadWorkflows() {
  const run = watched();
  loadWorkflows(run && run.workflowId);
}

function followHash() {
  const target = parseHash();
  if (!target) return;
  const run = watched();
  if (run && run.id === target.executionId) return;
  attach(target.executionId, target.token);
}

function opened(executionId, token) {
  history.pushState(null, "", `#${hashOf(executionId, token)}`);
  attach(executionId, token);
  reveal();
}

// "Run again with this input": the start form gets the watched run's workflow and input.
function runAgain() {
  const run = watched();
  if (!run || !run.inputKnown || !run.workflowId) return;
  if (!fillForm(run.workflowId, run.input)) return;
  $("launch").scrollIntoView({ block: "nearest" });
  $("input").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  const graph = new FlowGraph($("graph"), { load: loadDefinition, select: showBlockRow });
  drawOn(graph);
  // The workflow picked, drawn before it runs; its nodes have no timeline row to open.
  const preview = new FlowGraph($("preview"), { load: loadDefinition, select: () => false, prefix: "preview" });
  previewOn(preview);
  renderKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const typed = $("api-key").value.trim();
    if (typed) setKey(typed);
  });
  $("key-forget").addEventListener("click", () => setKey(""));
  document.addEventListener("flowcast:key", () => {
    reloadWorkflows();
    graph.reload();
    preview.reload();
  });
  $("run-again").addEventListener("click", runAgain);
  $("workflow").addEventListener("change", describeWorkflow);
  $("start-form").addEventListener("submit", (event) => start(event, opened));
  $("pause").addEventListener("submit", (event) => {
    event.preventDefault();
    resume(watched(), true);
  });
  $("pause-reject").addEventListener("click", () => resume(watched(), false));
  $("cancel").addEventListener("click", cancel);
  window.addEventListener("hashchange", followHash);
  reloadWorkflows();
  followHash();
});
