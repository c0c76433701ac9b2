// The API key in use in this tab. It lives in sessionStorage, so it survives a reload but
// not the tab; a change fires "flowcast:key" on the document for the parts that depend on it.

import { $, show } from "./dom.js";

const KEY_STORAGE = "flowcast.apiKey";

let key = sessionStorage.getItem(KEY_STORAGE) || "";

export function apiKey() {
  return key;
}

export function renderKey() {
  $("api-key").value = "";
  $("api-key").placeholder = key ? "in use in this tab" : "if the server needs one";
  show($("key-forget"), Boolean(key));
}

/** Use `typed` from now on ("" forgets the key). */
export function setKey(typed) {
  key = typed;
  if (typed) sessionStorage.setItem(KEY_STORAGE, typed);
  else sessionStorage.removeItem(KEY_STORAGE);
  renderKey();
  document.dispatchEvent(new CustomEvent("flowcast:key"));
}
