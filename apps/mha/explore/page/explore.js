// The page of `mha explore`: asks the server (/api/model, /api/translate, /api/accuracy) and draws
// the answers; the attention maps are drawn here, on canvases, from the weights in the JSON.
"use strict";

const WHAT_KINDS_DO = {
  encoder_self: "Each character of the input (a row) reads the input's characters (the columns).",
  decoder_self: "Each position of the answer so far (a row; ^ is the start) reads the answer's earlier " +
    "positions (the columns): masked, so that it never sees what comes after it.",
  cross: "Each position of the answer (a row) reads the input (the columns): where the decoder looks " +
    "for the year, the month and the day.",
};
const TYPING_PAUSE_MS = 200;  // translate once typing pauses this long

const state = {
  model: null,
  off: new Set(),      // "kind.layer.head" of the heads switched off
  translated: 0,       // answers drawn so far (tests wait on it: body[data-translated])
  request: null,       // the AbortController of the translation in flight
  accuracyFor: "",     // the head set the accuracy shown is for
};

const $ = (id) => document.getElementById(id);
const headKey = (kind, layer, head) => `${kind}.${layer}.${head}`;

function headsOff() {
  return [...state.off].sort().map((key) => {
    const [kind, layer, head] = key.split(".");
    return [Number(layer), kind, Number(head)];
  });
}

async function postJson(path, body, signal) {
  const response = await fetch(path, {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body), signal,
  });
  const json = await response.json().catch(() => ({error: `HTTP ${response.status}`}));
  if (!response.ok) throw new Error(json.error || `HTTP ${response.status}`);
  return json;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
  for (const id of ["answer", "maps"]) $(id).classList.toggle("stale", Boolean(message));
}

// ---- the maps ---------------------------------------------------------------------------------------

function buildMaps(model) {
  const maps = $("maps");
  for (const kind of model.kinds) {
    const section = document.createElement("section");
    section.className = "kind";
    section.innerHTML = "<h2></h2><p class='what'></p>";
    section.querySelector("h2").textContent = kind.name;
    section.querySelector(".what").textContent = WHAT_KINDS_DO[kind.kind] || "";
    for (let layer = 0; layer < kind.layers; ++layer) {
      const row = document.createElement("div");
      row.className = "layer";
      const name = document.createElement("div");
      name.className = "layer-name";
      name.textContent = `layer ${layer}`;
      row.appendChild(name);
      for (let head = 0; head < model.heads; ++head) row.appendChild(headCard(kind.kind, layer, head));
      section.appendChild(row);
    }
    maps.appendChild(section);
  }
}

function headCard(kind, layer, head) {
  const card = document.createElement("figure");
  card.className = "head";
  card.innerHTML = "<div class='head-title'><span></span><label><input type='checkbox' checked> on</label></div>" +
    "<canvas></canvas>";
  card.querySelector("span").textContent = `head ${head}`;
  const toggle = card.querySelector("input");
  toggle.className = "head-toggle";
  toggle.title = `switch head ${head} of layer ${layer} (${kind}) on or off`;
  Object.assign(toggle.dataset, {kind, layer, head});
  toggle.addEventListener("change", () => {
    const key = headKey(kind, layer, head);
    if (toggle.checked) state.off.delete(key); else state.off.add(key);
    card.classList.toggle("off", !toggle.checked);
    headsChanged();
  });
  const canvas = card.querySelector("canvas");
  Object.assign(canvas.dataset, {kind, layer, head});
  canvas.addEventListener("mousemove", (event) => showWeight(canvas, event));
  canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  return card;
}

// Geometry of a map: cells of `cell` pixels after a margin for the labels.
function layout(queries, keys) {
  const cell = Math.max(7, Math.min(16, Math.floor(240 / Math.max(queries.length, keys.length, 1))));
  return {cell, left: cell + 6, top: cell + 6};
}

function drawMap(canvas, weights, queries, keys) {
  const {cell, left, top} = layout(queries, keys);
  canvas.width = left + keys.length * cell;
  canvas.height = top + queries.length * cell;
  Object.assign(canvas, {weights, queries, keys});
  Object.assign(canvas.dataset, {cell, left, top});  // where the cells are (the tests hover over one)
  const g = canvas.getContext("2d");
  g.fillStyle = "#fff";
  g.fillRect(0, 0, canvas.width, canvas.height);
  let checksum = 0;
  weights.forEach((row, i) => row.forEach((w, j) => {
    const shade = (from, to) => Math.round(from + (to - from) * Math.min(1, Math.max(0, w)));
    g.fillStyle = `rgb(${shade(255, 8)}, ${shade(255, 48)}, ${shade(255, 107)})`;
    g.fillRect(left + j * cell, top + i * cell, cell, cell);
    checksum += w * (1 + i * 131 + j);
  }));
  canvas.dataset.checksum = checksum.toFixed(4);  // changes when the weights do (the tests read it)
  g.fillStyle = "#333";
  g.font = `${Math.max(7, cell - 3)}px ui-monospace, monospace`;
  g.textAlign = "center";
  g.textBaseline = "middle";
  keys.forEach((label, j) => g.fillText(label, left + (j + 0.5) * cell, top / 2));
  queries.forEach((label, i) => g.fillText(label, left / 2, top + (i + 0.5) * cell));
}

function showWeight(canvas, event) {
  const tooltip = $("tooltip");
  if (!canvas.weights) return;
  const {cell, left, top} = layout(canvas.queries, canvas.keys);
  const rect = canvas.getBoundingClientRect();
  const i = Math.floor((event.clientY - rect.top - top) / cell), j = Math.floor((event.clientX - rect.left - left) / cell);
  if (i < 0 || j < 0 || i >= canvas.queries.length || j >= canvas.keys.length) {
    tooltip.hidden = true;
    return;
  }
  tooltip.textContent = `query ${i} '${canvas.queries[i]}' -> key ${j} '${canvas.keys[j]}': ` +
    canvas.weights[i][j].toFixed(4);
  tooltip.style.left = `${event.clientX + 12}px`;
  tooltip.style.top = `${event.clientY + 12}px`;
  tooltip.hidden = false;
}

// ---- answers ----------------------------------------------------------------------------------------

function showAnswer(answer) {
  $("translation").textContent = answer.translation || "(nothing)";
  $("confidence").textContent = answer.confidence.toFixed(4);
  const validity = $("validity");
  validity.textContent = answer.doubt ? `? ${answer.doubt}` : "passes: a calendar date, the input's year, confident";
  validity.className = answer.doubt ? "doubtful" : "passes";
  $("translation").className = answer.doubt ? "doubtful" : "passes";
  for (const kind of answer.maps) {
    kind.layers.forEach((heads, layer) => heads.forEach((weights, head) => {
      const canvas = document.querySelector(`canvas[data-kind="${kind.kind}"][data-layer="${layer}"][data-head="${head}"]`);
      if (canvas) drawMap(canvas, weights, kind.queries, kind.keys);
    }));
  }
  state.translated += 1;
  document.body.dataset.translated = String(state.translated);
}

async function translate() {
  if (state.request) state.request.abort();  // only the latest input's answer matters
  const request = new AbortController();
  state.request = request;
  try {
    const answer = await postJson("/api/translate", {text: $("date-input").value, heads_off: headsOff()},
      request.signal);
    if (request !== state.request) return;
    showError("");
    showAnswer(answer);
  } catch (error) {
    if (error.name !== "AbortError" && request === state.request) showError(error.message);
  }
}

async function updateAccuracy() {
  const off = headsOff(), key = JSON.stringify(off);
  state.accuracyFor = key;
  $("accuracy").textContent = "computing...";
  try {
    const result = await postJson("/api/accuracy", {heads_off: off});
    if (state.accuracyFor !== key) return;  // the heads changed meanwhile
    $("accuracy").textContent = `${(100 * result.accuracy).toFixed(1)}% (${result.correct} of ${result.examples})`;
    $("accuracy").dataset.headsOff = String(off.length);
  } catch (error) {
    if (state.accuracyFor === key) $("accuracy").textContent = `not available: ${error.message}`;
  }
}

function headsChanged() {
  $("heads-off-count").textContent = state.off.size ? String(state.off.size) : "none";
  translate();
  updateAccuracy();
}

async function start() {
  const response = await fetch("/api/model");
  state.model = await response.json();
  $("accuracy-note").textContent = `Exact matches on the ${state.model.held_out_examples} held-out dates ` +
    "mha demo measured the model on (dates never seen in training), with the heads switched off as they are now.";
  buildMaps(state.model);
  let timer = 0;
  $("date-input").addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(translate, TYPING_PAUSE_MS);
  });
  $("all-on").addEventListener("click", () => {
    state.off.clear();
    for (const toggle of document.querySelectorAll(".head-toggle")) {
      toggle.checked = true;
      toggle.closest(".head").classList.remove("off");
    }
    headsChanged();
  });
  translate();
  updateAccuracy();
  postJson("/api/accuracy", {heads_off: []}).then((every) => {
    $("accuracy-baseline").textContent = `(every head on: ${(100 * every.accuracy).toFixed(1)}%)`;
  }, () => {});
}

document.addEventListener("DOMContentLoaded", () => start().catch((error) => showError(String(error))));
