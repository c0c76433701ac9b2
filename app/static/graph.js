// The workflow drawn as a graph: blocks as nodes in layers by dependency, edges with
// their `when` conditions, each node showing its block's live status.
//
// Plain SVG with the layered layout of graph-layout.js: no library and no build step. Pan
// with a drag, zoom with the wheel or the buttons, "Fit" for the whole graph.
//
// page.js builds one FlowGraph; watch.js, which owns the run, calls reset() when it
// attaches to an execution and apply(event) for every event; the graph loads the
// workflow's definition by itself (through the `load` it is given) and calls
// `select(blockId)` on a click.

import { decisionOf } from "./format.js";
import { LAYOUT, cutText, layoutWorkflow } from "./graph-layout.js";

export class FlowGraph {
  static PAD = 16;
  static FAR = 0.5; // below this zoom the text goes and only shapes and icons stay
  static PENDING = Object.freeze({ status: "pending", attempt: 0, type: "", rerun: false, decision: "" });
  static STATES = ["pending", "running", "retrying", "paused", "completed", "failed", "skipped", "cancelled"];

  constructor(root, { load, select, prefix = "graph" }) {
    this.root = root;
    // The ids of its buttons and SVG symbols start with it: a second graph on the page
    // (the launch panel's preview) has ids of its own.
    this.prefix = prefix;
    this.load = load; // workflowId -> Promise of the workflow's JSON (throws an Error with a message)
    this.select = select; // blockId -> true if the page showed it
    this.generation = 0;
    this.build();
    this.reset();
  }

  // ---------------------------------------------------------------- the run

  /** A new run: forget every status and the drawing. */
  reset() {
    this.generation += 1;
    this.workflowId = null;
    this.failedLoad = false;
    this.states = new Map(); // blockId -> {status, attempt, type, rerun}
    this.nodes = new Map(); // blockId -> the node's elements
    this.incoming = new Map(); // blockId -> the paths and condition labels that enter it
    this.strangers = new Set(); // blocks the run names that the definition read lacks
    this.place = ""; // while the run waits in line: where it stands, said under the graph
    this.size = null;
    this.moved = false;
    this.drawing.replaceChildren();
    this.note("");
    this.root.hidden = true;
  }

  /** The run waits in line for a worker (to start, or to go on with a resume's answer):
  draw its workflow and say its place (`queued, 3 ahead`) under it until it runs. */
  queued(workflowId, place) {
    this.place = `Waiting for a worker: ${place}.`;
    if (this.workflowId === null && workflowId) {
      this.workflowId = workflowId;
      this.fetch();
    }
    this.note(this.strangerNote());
  }

  /** One event of the run, in id order (a replay and the live tail alike). */
  apply(event) {
    if (this.place && (event.type === "execution:started" || event.type === "execution:resumed")) {
      this.place = "";
      this.note(this.strangerNote());
    }
    if (this.workflowId === null && event.workflowId) {
      this.workflowId = event.workflowId;
      this.fetch();
    }
    const data = event.data || {};
    switch (event.type) {
      case "block:started":
        this.set(data.blockId, "running", { attempt: data.attempt, type: data.blockType });
        break;
      case "block:chunk":
        this.set(data.blockId, "running");
        break;
      case "block:completed":
        this.set(data.blockId, "completed");
        break;
      case "block:failed":
        this.set(data.blockId, data.willRetry ? "retrying" : "failed", { attempt: data.attempt });
        break;
      case "block:skipped":
        this.set(data.blockId, "skipped");
        break;
      case "execution:paused":
        this.set(data.blockId, "paused");
        break;
      case "execution:resumed":
        // What the person answered stays on the node: "approved", "rejected".
        this.set(data.blockId, "running", { decision: decisionOf(data.input).decision });
        break;
      case "execution:recovered":
        // The blocks it names run again at once; the kept ones are done, even if the
        // events that said so were evicted.
        for (const blockId of data.completed || []) this.set(blockId, "completed");
        for (const blockId of data.rerun || []) this.set(blockId, "running", { rerun: true });
        break;
      case "execution:failed":
      case "execution:cancelled":
        // Blocks still in flight were stopped with the run: no event of their own says so.
        for (const [blockId, state] of this.states) {
          if (["running", "retrying", "paused"].includes(state.status)) this.set(blockId, "cancelled");
        }
        break;
      default:
        break;
    }
  }

  /** Draw `workflowId` with every block pending, before any run (the launch panel's
  preview of the workflow picked). */
  preview(workflowId) {
    if (workflowId === this.workflowId && !this.failedLoad) return;
    this.reset();
    if (!workflowId) return;
    this.workflowId = workflowId;
    this.fetch();
  }

  /** The API key changed: a definition refused before may be readable now. */
  reload() {
    if (this.failedLoad && this.workflowId) this.fetch();
  }

  set(blockId, status, extra = {}) {
    if (!blockId) return;
    const state = this.states.get(blockId) || FlowGraph.PENDING;
    if (state.status === status && Object.keys(extra).length === 0) return; // chunk after chunk
    const next = { ...state, status };
    for (const [name, value] of Object.entries(extra)) if (value !== undefined) next[name] = value;
    this.states.set(blockId, next);
    this.paint(blockId, next);
  }

  async fetch() {
    const generation = this.generation;
    this.failedLoad = false;
    let workflow;
    try {
      workflow = await this.load(this.workflowId);
    } catch (error) {
      if (generation !== this.generation) return;
      this.failedLoad = true;
      this.root.hidden = false;
      this.svg.toggleAttribute("hidden", true);
      this.note(`No graph: ${error.message}`);
      return;
    }
    if (generation === this.generation) this.draw(workflow);
  }

  // ---------------------------------------------------------------- the frame

  build() {
    const button = (id, text, title) => {
      const node = document.createElement("button");
      Object.assign(node, { type: "button", id, textContent: text, title });
      return node;
    };
    const title = document.createElement("h3");
    title.textContent = "Graph";
    this.count = document.createElement("span");
    this.count.className = "hint";
    const spacer = document.createElement("span");
    spacer.className = "spacer";
    const zoomOut = button(`${this.prefix}-zoom-out`, "−", "Zoom out");
    const zoomIn = button(`${this.prefix}-zoom-in`, "+", "Zoom in");
    const fit = button(`${this.prefix}-fit`, "Fit", "Fit the whole graph in view");
    const bar = document.createElement("div");
    bar.className = "graph-bar";
    bar.append(title, this.count, spacer, zoomOut, zoomIn, fit);

    this.svg = this.el("svg", { class: "graph-canvas", role: "group", "aria-label": "Workflow graph" });
    this.svg.append(this.defs());
    this.view = this.el("g", { class: "graph-view" });
    this.drawing = this.el("g");
    this.view.append(this.drawing);
    this.svg.append(this.view);

    this.legendList = this.legend();
    this.noteLine = document.createElement("p");
    this.noteLine.className = "graph-note hint";
    this.noteLine.setAttribute("role", "status");
    this.root.replaceChildren(bar, this.svg, this.legendList, this.noteLine);

    zoomIn.addEventListener("click", () => this.zoomAt(1.25));
    zoomOut.addEventListener("click", () => this.zoomAt(0.8));
    fit.addEventListener("click", () => this.fit());
    this.panning();
    window.addEventListener("resize", () => {
      if (this.size && !this.moved) this.fit();
    });
  }

  el(tag, attrs = {}, ...children) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    node.append(...children);
    return node;
  }

  text(x, y, content, cls) {
    const node = this.el("text", { x, y, class: cls });
    node.textContent = content;
    return node;
  }

  defs() {
    const circle = (fill) => this.el("circle", { cx: 8, cy: 8, r: 7, fill });
    const mark = (d) => this.el("path", { d, fill: "none", stroke: "#fff", "stroke-width": 2, "stroke-linecap": "round", "stroke-linejoin": "round" });
    const solid = (d) => this.el("path", { d, fill: "#fff" });
    // Each status has its own shape as well as its colour, and its word beside it.
    const icons = {
      pending: [this.el("circle", { cx: 8, cy: 8, r: 6, fill: "#fff", stroke: "#8a94a3", "stroke-width": 2, "stroke-dasharray": "3 2" })],
      running: [circle("#2f6fec"), solid("M6 4.5 L11.5 8 L6 11.5 Z")],
      retrying: [circle("#b86e00"), mark("M11.2 6.2 A3.6 3.6 0 1 0 11.6 9"), solid("M9.4 5.2 L12.6 4.4 L12 7.6 Z")],
      paused: [circle("#b86e00"), solid("M5.4 4.6 H7.2 V11.4 H5.4 Z"), solid("M8.8 4.6 H10.6 V11.4 H8.8 Z")],
      completed: [circle("#1f8a4c"), mark("M4.6 8.3 L7 10.6 L11.4 5.6")],
      failed: [circle("#c62f3a"), mark("M5.4 5.4 L10.6 10.6 M10.6 5.4 L5.4 10.6")],
      skipped: [this.el("circle", { cx: 8, cy: 8, r: 6, fill: "#fff", stroke: "#8a94a3", "stroke-width": 2 }),
        this.el("path", { d: "M4 12 L12 4", stroke: "#8a94a3", "stroke-width": 2 })],
      cancelled: [circle("#6b7482"), solid("M5.2 5.2 H10.8 V10.8 H5.2 Z")],
    };
    const defs = this.el("defs");
    for (const [status, parts] of Object.entries(icons)) {
      defs.append(this.el("symbol", { id: `${this.prefix}-icon-${status}`, viewBox: "0 0 16 16" }, ...parts));
    }
    defs.append(
      this.el("marker", { id: `${this.prefix}-arrow`, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse", markerUnits: "userSpaceOnUse" },
        this.el("path", { d: "M0 0 L10 5 L0 10 Z", class: "graph-arrowhead" })),
    );
    return defs;
  }

  legend() {
    const list = document.createElement("ul");
    list.className = "graph-legend";
    list.setAttribute("aria-label", "Statuses");
    for (const status of FlowGraph.STATES) {
      const item = document.createElement("li");
      const icon = this.el("svg", { viewBox: "0 0 16 16", width: 14, height: 14, "aria-hidden": "true" },
        this.el("use", { href: `#${this.prefix}-icon-${status}` }));
      item.append(icon, status);
      list.append(item);
    }
    return list;
  }

  note(text) {
    this.noteLine.textContent = text;
    this.noteLine.hidden = !text;
  }

  // ---------------------------------------------------------------- drawing

  draw(workflow) {
    const { PAD } = FlowGraph;
    const placed = layoutWorkflow(workflow);
    this.drawing.replaceChildren();
    this.nodes.clear();
    this.incoming.clear();
    const edges = this.el("g", { class: "graph-edges" });
    const labels = this.el("g", { class: "graph-labels" });
    const nodes = this.el("g", { class: "graph-nodes" });
    for (const edge of placed.edges) this.drawEdge(edge, edges, labels);
    for (const node of placed.nodes) {
      nodes.append(this.drawNode(node));
      this.paint(node.id, this.states.get(node.id) || FlowGraph.PENDING);
    }

    this.drawing.append(edges, labels, nodes);
    this.size = { width: placed.width + 2 * PAD, height: placed.height + 2 * PAD };
    this.count.textContent = `${placed.nodes.length} blocks, ${placed.edges.length} edges`;
    this.root.hidden = false;
    this.svg.toggleAttribute("hidden", false);
    for (const blockId of this.states.keys()) if (!this.nodes.has(blockId)) this.strangers.add(blockId);
    this.note(this.strangerNote());
    // As tall as the drawing needs at full size, within bounds; wider ones fit by zooming.
    this.svg.style.height = `${Math.round(Math.min(460, Math.max(120, this.size.height)))}px`;
    this.moved = false;
    this.fit();
  }

  /** An edge's path into `edges`, and its condition's label (if any) into `labels`. */
  drawEdge(edge, edges, labels) {
    const path = this.el("path", { d: edge.d, class: "graph-edge", "marker-end": `url(#${this.prefix}-arrow)`, "data-from": edge.from, "data-to": edge.to });
    edges.append(path);
    if (!this.incoming.has(edge.to)) this.incoming.set(edge.to, []);
    this.incoming.get(edge.to).push(path);
    if (edge.when) {
      const shown = cutText(edge.when, LAYOUT.LABEL_CHARS);
      const width = shown.length * LAYOUT.CHAR_W + 10;
      const label = this.el("g", { class: "graph-label", transform: `translate(${edge.label.x} ${edge.label.y})`, "data-to": edge.to },
        this.el("title"),
        this.el("rect", { x: -width / 2, y: -9, width, height: 18, rx: 4 }),
        this.text(0, 4, shown, "graph-when"));
      label.firstChild.textContent = `when ${edge.when}`;
      labels.append(label);
      this.incoming.get(edge.to).push(label);
    }
  }

  /** A block's node, which opens the block's timeline row on a click or a key. */
  drawNode(node) {
    const { NODE_W, NODE_H } = LAYOUT;
    const group = this.el("g", {
      class: "graph-node", transform: `translate(${node.x} ${node.y})`, tabindex: 0, role: "button",
      "data-block-id": node.id, "data-status": "pending",
    });
    const title = this.el("title");
    const box = this.el("rect", { width: NODE_W, height: NODE_H, rx: 8, class: "graph-box" });
    const icon = this.el("use", { href: `#${this.prefix}-icon-pending`, x: 10, y: 8, width: 16, height: 16, class: "graph-icon" });
    const name = this.text(34, 20, cutText(node.id, 19), "graph-name");
    const line = this.text(34, 36, "", "graph-state");
    group.append(title, box, icon, name, line);
    const open = () => {
      for (const other of this.drawing.querySelectorAll(".graph-node.selected")) other.classList.remove("selected");
      group.classList.add("selected");
      const shown = this.select(node.id);
      this.note(shown ? this.strangerNote() : `${node.id} has not run yet: it has no row in the timeline.`);
    };
    group.addEventListener("click", (event) => {
      if (!this.dragged) open();
      event.stopPropagation();
    });
    group.addEventListener("keydown", (event) => {
      if (event.key === "Enter" || event.key === " ") {
        event.preventDefault();
        open();
      }
    });
    this.nodes.set(node.id, { group, title, icon, line, type: node.type });
    return group;
  }

  paint(blockId, state) {
    const node = this.nodes.get(blockId);
    if (!node) {
      // Not drawn yet (its state waits for the drawing), or the workflow was replaced
      // since this run started and the definition read now lacks the block.
      if (this.size && !this.strangers.has(blockId)) {
        this.strangers.add(blockId);
        this.note(this.strangerNote());
      }
      return;
    }
    const { group, title, icon, line } = node;
    const type = state.type || node.type;
    if (group.dataset.status !== state.status) {
      group.dataset.status = state.status;
      icon.setAttribute("href", `#${this.prefix}-icon-${state.status}`);
      // A skipped block's edges were not taken: they fade with it.
      for (const edge of this.incoming.get(blockId) || []) edge.dataset.state = state.status;
    }
    const tries = state.attempt > 1 ? ` · try ${state.attempt}` : state.rerun ? " · re-run" : "";
    // An answered approval that completed says the answer instead ("rejected · approval").
    const decided = state.status === "completed" && ["approved", "rejected"].includes(state.decision);
    const word = decided ? state.decision : state.status;
    line.textContent = `${word} · ${type}${tries}`;
    if (decided) group.dataset.decision = state.decision;
    else delete group.dataset.decision;
    const said = decided ? ` (${state.decision})` : "";
    title.textContent = `${blockId} (${type}): ${state.status}${said}${state.attempt > 1 ? `, attempt ${state.attempt}` : ""}`;
    group.setAttribute("aria-label", `${blockId}, ${state.status}${said}`);
  }

  strangerNote() {
    if (this.place) return this.place;
    if (!this.strangers.size) return "";
    const names = [...this.strangers].join(", ");
    return `The workflow was changed after this run started: ${names} not in the graph.`;
  }

  // ---------------------------------------------------------------- pan and zoom

  transform(scale, x, y) {
    this.zoom = { scale, x, y };
    this.view.setAttribute("transform", `translate(${x} ${y}) scale(${scale})`);
    this.svg.dataset.zoom = scale.toFixed(3);
    this.svg.classList.toggle("far", scale < FlowGraph.FAR);
  }

  /** Everything in view, centred, never larger than full size. */
  fit() {
    if (!this.size) return;
    const width = this.svg.clientWidth || 1;
    const height = this.svg.clientHeight || 1;
    const scale = Math.min(1, width / this.size.width, height / this.size.height);
    const x = (width - this.size.width * scale) / 2 + FlowGraph.PAD * scale;
    const y = (height - this.size.height * scale) / 2 + FlowGraph.PAD * scale;
    this.moved = false;
    this.fitScale = scale;
    this.transform(scale, x, y);
  }

  /** Zoom by `factor` around a point of the canvas (its centre by default). */
  zoomAt(factor, px = this.svg.clientWidth / 2, py = this.svg.clientHeight / 2) {
    if (!this.zoom) return;
    const { scale, x, y } = this.zoom;
    // Never further out than fitting needs (a 500-block chain fits only very small).
    const next = Math.min(3, Math.max(Math.min(0.05, this.fitScale), scale * factor));
    const ratio = next / scale;
    this.moved = true;
    this.transform(next, px - (px - x) * ratio, py - (py - y) * ratio);
  }

  panning() {
    const svg = this.svg;
    let start = null;
    this.dragged = false;
    svg.addEventListener("wheel", (event) => {
      if (!this.zoom) return;
      event.preventDefault();
      const lines = event.deltaMode === 1 ? 16 : 1;
      const box = svg.getBoundingClientRect();
      this.zoomAt(Math.exp(-event.deltaY * lines * 0.0015), event.clientX - box.left, event.clientY - box.top);
    }, { passive: false });
    svg.addEventListener("pointerdown", (event) => {
      if (event.button !== 0 || !this.zoom) return;
      start = { px: event.clientX, py: event.clientY, x: this.zoom.x, y: this.zoom.y, id: event.pointerId };
      this.dragged = false;
    });
    svg.addEventListener("pointermove", (event) => {
      if (!start || event.pointerId !== start.id) return;
      const dx = event.clientX - start.px;
      const dy = event.clientY - start.py;
      if (!this.dragged && Math.hypot(dx, dy) < 4) return;
      if (!this.dragged) {
        // Captured only once it is a drag, so a plain click still reaches its node.
        this.dragged = true;
        svg.setPointerCapture(event.pointerId);
        svg.classList.add("dragging");
      }
      this.moved = true;
      this.transform(this.zoom.scale, start.x + dx, start.y + dy);
    });
    const end = (event) => {
      if (!start || event.pointerId !== start.id) return;
      start = null;
      svg.classList.remove("dragging");
      // The click that ends a drag comes after this; it must not open a node.
      setTimeout(() => {
        this.dragged = false;
      }, 0);
    };
    svg.addEventListener("pointerup", end);
    svg.addEventListener("pointercancel", end);
  }
}
