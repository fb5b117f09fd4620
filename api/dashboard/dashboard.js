// lockledger dashboard: reads the public API (docs/dashboard.md) and draws the fleet, live or at a past
// instant. Plain ES module, no framework, no build step. Every request carries the dashboard token from
// sessionStorage when there is one; a 401 shows the token form (in dev mode none is asked for).
//
// Data: /v1/locks (held locks, re-polled every few seconds), /v1/events/stream (the change feed: tables
// update on each event), /v1/sagas (in flight and stuck), /v1/stats (conflicts/s from this server's
// counters), /v1/stats/agents (each agent's holds, mean hold and lapses, from the agent_stats projector),
// /v1/replay/state and /v1/replay/changes (the time slider), /v1/locks/{resource} (a lock's detail: its
// fair queue in order). Each held lock shows the reservation it was taken in (a badge: clicking it shows
// that reservation's locks alone) and how many acquires wait for it (`queued`). Shared locks (read/write
// locks and semaphores) have a table of their own: their grants from /v1/shared-locks (re-polled) and the
// feed's SHARED_* events, a mode badge each (read, write, permit k of N); a shared lock's detail shows
// its holders and its queue, each waiter's mode with it (/v1/shared-locks/{resource}). At a past instant
// the held table shows the replay's mutex leases, the shared table its grants (those with a mode). Times
// come from the server's clock: the offset to it is measured on each /v1/locks answer (its `at`).

import { setUpTimeline } from "./timeline.js";

const TOKEN_KEY = "lockledger.token";
const LOCK_POLL_MS = 3000;
const SAGA_POLL_MS = 5000;
const STATS_POLL_MS = 2000;
const EXPIRING_MS = 10_000;
const AROUND_MS = 30_000; // events shown around a scrubbed instant, each side (narrowed on a busy fleet)
const MIN_AROUND_MS = 100;
const HALF_PAGE = 500; // events shown each side of it, at most
const SLIDER_SPAN_MS = 3600_000;
const MAX_EVENTS = 150;
const SHARED_STREAM = "shared/"; // a shared lock's stream in the log: "shared/<resource>"
const ENDED_KEPT_MS = 60_000; // how long an ended grant is remembered, so a list read before its end cannot revive it

const $ = (id) => document.getElementById(id);

const state = {
  locks: new Map(), // resource -> {version, seenAt (ms, server clock), lock | null (null: freed)}
  offsetMs: 0, // server clock minus this browser's
  events: [], // newest first, from the feed
  sagas: { inFlight: [], stuck: [] },
  scrub: null, // {at: ms, locks: mutex leases, grants: shared-lock grants, changes: [...]} viewing the past
  grants: new Map(), // second -> LOCK_ACQUIRED events seen
  expiries: new Map(), // minute -> LOCK_EXPIRED events seen
  conflicts: [], // {at, rate} from two /v1/stats reads of one process
  lastStats: null,
  agentStats: new Map(), // owner -> {holds, ended, mean_hold_ms, lapses} from /v1/stats/agents
  reservation: null, // the reservation id the held table is narrowed to, if any
  shared: new Map(), // "resource#token" -> {seenAt (ms, server clock), grant} of live shared-lock grants
  sharedEnded: new Map(), // "resource#token" -> when its end was seen
  sharedCut: false, // the live list had more than a page
  // {resource, shared, lock: the /v1/locks/{resource} or /v1/shared-locks/{resource} answer | null} while a
  // lock's detail is open
  detail: null,
  tokenWaiters: [],
};

const serverNow = () => Date.now() + state.offsetMs;

// ---- HTTP ---------------------------------------------------------------------------------------------

class NeedToken extends Error {}

function authHeaders() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function api(path) {
  const response = await fetch(path, { headers: { Accept: "application/json", ...authHeaders() } });
  if (response.status === 401) {
    askForToken(sessionStorage.getItem(TOKEN_KEY) ? "This token is unknown or revoked." : "");
    throw new NeedToken();
  }
  if (response.status === 403) {
    askForToken("This token's role may not read the lock state: use a dashboard token.");
    throw new NeedToken();
  }
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function tokenReady() {
  if ($("token-overlay").hidden) return Promise.resolve();
  return new Promise((resolve) => state.tokenWaiters.push(resolve));
}

function askForToken(message) {
  if (message || $("token-overlay").hidden) $("token-error").textContent = message;
  $("token-overlay").hidden = false;
  $("token").focus();
}

function acceptToken(event) {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  $("token-overlay").hidden = true;
  $("forget-token").hidden = false;
  for (const resolve of state.tokenWaiters.splice(0)) resolve();
  refreshAll();
}

// ---- the change feed: fetch() + ReadableStream, as EventSource cannot send Authorization ----------------

// Parses server-sent events (id:, event:, data: lines; a blank line ends a message; ':' starts a comment)
// from text chunks, calling onMessage({id, event, data}) per message.
function sseParser(onMessage) {
  let buffer = "";
  return (chunk) => {
    buffer += chunk.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const message = { id: null, event: "message", data: [] };
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "id") message.id = value;
        else if (field === "event") message.event = value;
        else if (field === "data") message.data.push(value);
      }
      if (message.data.length) onMessage({ ...message, data: message.data.join("\n") });
    }
  };
}

// Follows /v1/events/stream for ever: after a drop (or an overflow) it reconnects with Last-Event-ID, so
// no event is missed, and re-reads the locks.
async function followFeed() {
  let lastId = null;
  let backoffMs = 500;
  for (;;) {
    await tokenReady();
    try {
      const headers = { Accept: "text/event-stream", ...authHeaders() };
      if (lastId) headers["Last-Event-ID"] = lastId;
      const response = await fetch("/v1/events/stream", { headers });
      if (response.status === 401 || response.status === 403) {
        askForToken(response.status === 403 ? "This token's role may not follow the feed." : "");
        continue;
      }
      if (!response.ok || !response.body) throw new Error(`feed: HTTP ${response.status}`);
      setFeedStatus("live");
      backoffMs = 500;
      if (lastId) for (const poll of [pollLocks, pollShared]) poll().catch(() => {});
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      const feed = sseParser((message) => {
        if (message.id) lastId = message.id;
        if (message.event !== "overflow") onEvent(JSON.parse(message.data));
      });
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        feed(value);
      }
    } catch (error) {
      if (!(error instanceof TypeError)) console.warn("feed:", error);
    }
    setFeedStatus("reconnecting");
    await sleep(backoffMs);
    backoffMs = Math.min(backoffMs * 2, 10_000);
  }
}

const LOCK_ENDS = new Set(["LOCK_RELEASED", "LOCK_EXPIRED", "LOCK_FORCE_RELEASED"]);
const SHARED_ENDS = new Set(["SHARED_RELEASED", "SHARED_EXPIRED"]);

function onEvent(event) {
  const at = Date.parse(event.recorded_at);
  state.events.unshift(event);
  state.events.length = Math.min(state.events.length, MAX_EVENTS);
  if (event.type === "LOCK_ACQUIRED") bump(state.grants, Math.floor(at / 1000));
  if (event.type === "LOCK_EXPIRED") bump(state.expiries, Math.floor(at / 60_000));
  if (event.type === "LOCK_ACQUIRED" || event.type === "LOCK_RENEWED" || event.type === "LOCK_HANDED_OFF") {
    const data = event.data;
    const meta = event.metadata || {};
    // A hand-off begins the receiver's lease: the giver's saga and reservation are not the receiver's.
    const known = state.locks.get(event.stream)?.lock;
    const before = event.type === "LOCK_HANDED_OFF" ? null : known;
    remember(event.stream, event.version, at, {
      resource: event.stream,
      owner: data.owner,
      fencing_token: data.fencing_token,
      expires_at: data.expires_at,
      ttl_ms: data.ttl_ms,
      saga_id: meta.saga_id ?? before?.saga_id ?? null,
      saga_step: meta.saga_step ?? before?.saga_step ?? null,
      // A grant names its reservation; a renewal keeps the lease's (an acquire outside one names none).
      reservation_id: event.type === "LOCK_RENEWED" ? before?.reservation_id ?? null : meta.reservation_id ?? null,
      queued: known?.queued ?? 0, // the queue is not in the feed: the next poll of /v1/locks counts it
    });
  } else if (LOCK_ENDS.has(event.type)) {
    remember(event.stream, event.version, at, null);
  } else if (event.type.startsWith("SHARED_")) {
    onSharedEvent(event, at);
  } else if (!event.type.startsWith("LOCK_")) {
    soon(pollSagas, 200); // a saga moved
  }
  if (state.detail && detailStream(state.detail) === event.stream) soon(pollDetail, 200);
  render();
}

// A shared lock's grant begins, is renewed or ends. A renewal names no mode: the grant's known one, else the
// next list's.
function onSharedEvent(event, at) {
  const resource = event.stream.slice(SHARED_STREAM.length);
  const data = event.data;
  const key = grantKey(resource, data.fencing_token);
  if (SHARED_ENDS.has(event.type)) {
    state.shared.delete(key);
    state.sharedEnded.set(key, at);
    return;
  }
  if (state.sharedEnded.has(key)) return;
  const known = state.shared.get(key)?.grant;
  if (event.type !== "SHARED_ACQUIRED" && !known) soon(pollShared, 200);
  state.shared.set(key, {
    seenAt: at,
    grant: {
      resource,
      owner: data.owner,
      fencing_token: data.fencing_token,
      mode: data.mode ?? known?.mode ?? "shared",
      limit: "limit" in data ? data.limit : known?.limit ?? null,
      ttl_ms: data.ttl_ms,
      expires_at: data.expires_at,
    },
  });
}

const grantKey = (resource, token) => `${resource}#${token}`;
const detailStream = (detail) => (detail.shared ? SHARED_STREAM + detail.resource : detail.resource);

function remember(resource, version, seenAt, lock) {
  const known = state.locks.get(resource);
  if (known && known.version > version) return; // an older state than the one shown
  state.locks.set(resource, { version, seenAt, lock });
}

// ---- polls ---------------------------------------------------------------------------------------------

async function pollLocks() {
  const sent = Date.now();
  const page = await api("/v1/locks?limit=1000");
  const at = Date.parse(page.at);
  state.offsetMs = at - (sent + Date.now()) / 2;
  const listed = new Set();
  for (const lock of page.items) {
    listed.add(lock.resource);
    remember(lock.resource, lock.version, Date.parse(lock.updated_at), lock);
  }
  for (const [resource, known] of state.locks) {
    // Not listed: free as of `at`, unless the feed told of something newer.
    if (!listed.has(resource) && known.seenAt <= at) state.locks.delete(resource);
  }
  $("held-note").textContent = page.next_cursor ? "(the first 1,000)" : "";
  if (state.detail && !state.detail.shared) await pollDetail();
  render();
}

// Live shared-lock grants (GET /v1/shared-locks); a grant not listed is gone as of `at`, unless the feed
// told of it since.
async function pollShared() {
  const page = await api("/v1/shared-locks?limit=1000");
  const at = Date.parse(page.at);
  const listed = new Set();
  for (const grant of page.items) {
    const key = grantKey(grant.resource, grant.fencing_token);
    listed.add(key);
    if (!state.sharedEnded.has(key)) state.shared.set(key, { seenAt: at, grant });
  }
  for (const [key, known] of state.shared) if (!listed.has(key) && known.seenAt <= at) state.shared.delete(key);
  for (const [key, endedAt] of state.sharedEnded) if (endedAt < at - ENDED_KEPT_MS) state.sharedEnded.delete(key);
  state.sharedCut = Boolean(page.next_cursor);
  if (state.detail?.shared) await pollDetail();
  renderShared();
}

// A lock's detail: its state and its fair queue, first in line first (GET /v1/locks/{resource}); for a
// shared lock its holders too (GET /v1/shared-locks/{resource}).
async function pollDetail() {
  const detail = state.detail;
  if (!detail) return;
  const path = detail.shared ? "/v1/shared-locks/" : "/v1/locks/";
  const lock = await api(path + encodeURIComponent(detail.resource));
  if (state.detail !== detail) return; // closed or moved on meanwhile
  detail.lock = lock;
  renderDetail();
}

function openDetail(resource, shared = false) {
  state.detail = { resource, shared, lock: null };
  renderDetail();
  pollDetail().catch((error) => {
    if (!(error instanceof NeedToken)) console.warn(error);
  });
}

function closeDetail() {
  state.detail = null;
  renderDetail();
}

function showReservation(id) {
  state.reservation = id;
  renderLocks();
}

async function pollSagas() {
  const [running, compensating, stuck] = await Promise.all(
    ["running", "compensating", "stuck"].map((status) => api(`/v1/sagas?status=${status}&limit=200`)),
  );
  state.sagas.inFlight = [...running.items, ...compensating.items];
  state.sagas.stuck = stuck.items;
  render();
}

async function pollStats() {
  const stats = await api("/v1/stats");
  const previous = state.lastStats;
  state.lastStats = stats;
  if (!previous || previous.process.id !== stats.process.id) return; // a restart or another worker
  const seconds = (Date.parse(stats.at) - Date.parse(previous.at)) / 1000;
  const refused = (s) => Object.values(s.commands).reduce((sum, by) => sum + (by.lock_held || 0), 0);
  if (seconds <= 0) return;
  state.conflicts.push({ at: Date.parse(stats.at), rate: (refused(stats) - refused(previous)) / seconds });
  state.conflicts.splice(0, Math.max(0, state.conflicts.length - 60));
}

async function pollAgentStats() {
  const page = await api("/v1/stats/agents?limit=1000");
  state.agentStats = new Map(page.items.map((item) => [item.owner, item]));
}

function agentFigures(owner) {
  const figures = state.agentStats.get(owner);
  if (!figures) return "";
  const mean = figures.mean_hold_ms === null ? "–" : `${(figures.mean_hold_ms / 1000).toFixed(1)} s`;
  return `${figures.holds} holds · mean ${mean} · ${figures.lapses} lapses`;
}

function every(ms, poll) {
  const run = async () => {
    try {
      await poll();
    } catch (error) {
      if (!(error instanceof NeedToken)) console.warn(error);
    }
    setTimeout(run, ms);
  };
  run();
}

function refreshAll() {
  for (const poll of [pollLocks, pollShared, pollSagas, pollStats, pollAgentStats]) poll().catch(() => {});
  if (state.scrub) scrubTo(state.scrub.at);
}

// ---- the time slider -----------------------------------------------------------------------------------

async function scrubTo(at) {
  at = Math.min(at, serverNow() - 1000);
  const blank = { locks: [], grants: [], changes: [], before: AROUND_MS, after: AROUND_MS, cut: false };
  state.scrub = { ...(state.scrub ?? blank), at, ready: false };
  const instant = new Date(at).toISOString();
  history.replaceState(null, "", `?at=${encodeURIComponent(instant)}`);
  render();
  try {
    const [fleet, near] = await Promise.all([
      api(`/v1/replay/state?at=${encodeURIComponent(instant)}&limit=10000`),
      changesAround(at),
    ]);
    if (state.scrub?.at !== at) return; // moved on meanwhile
    // The mutex leases for the held table, a shared lock's grants (they have a mode) for its own card.
    const locks = fleet.locks.filter((lock) => lock.mode == null);
    const grants = fleet.locks.filter((lock) => lock.mode != null);
    state.scrub = { at, locks, grants, ...near, ready: true };
  } catch (error) {
    if (!(error instanceof NeedToken)) console.warn(error);
  }
  render();
}

// The events nearest an instant, at most a page (500) each side. After it: the first page of the 30 s
// after. Before it, where the API pages forwards only: the widest window up to 30 s whose events fit a page
// (bisected, to 100 ms), so a busy fleet shows the events just before the instant, not the first of the
// 30 s. `cut` says even 100 ms before it held more than a page.
async function changesAround(at) {
  const [[before, beforeMs, cut], after] = await Promise.all([
    nearestBefore(at),
    changesBetween(at, at + AROUND_MS),
  ]);
  return {
    changes: [...before.changes, ...after.changes],
    before: beforeMs,
    after: after.next_cursor ? Date.parse(after.changes.at(-1).at) - at : AROUND_MS,
    cut,
  };
}

async function nearestBefore(at) {
  const whole = await changesBetween(at - AROUND_MS, at);
  if (!whole.next_cursor) return [whole, AROUND_MS, false];
  let [fits, wide, best] = [0, AROUND_MS, null];
  while (wide - fits > MIN_AROUND_MS) {
    const tried = (fits + wide) / 2;
    const page = await changesBetween(at - tried, at);
    if (page.next_cursor) wide = tried;
    else [fits, best] = [tried, page];
  }
  if (best) return [best, fits, false];
  const narrowest = await changesBetween(at - MIN_AROUND_MS, at);
  return [narrowest, MIN_AROUND_MS, Boolean(narrowest.next_cursor)];
}

function changesBetween(from, to) {
  const iso = (ms) => encodeURIComponent(new Date(ms).toISOString());
  to = Math.min(to, serverNow() - 1000);
  return api(`/v1/replay/changes?from=${iso(from)}&to=${iso(to)}&limit=${HALF_PAGE}`);
}

function goLive() {
  state.scrub = null;
  history.replaceState(null, "", location.pathname);
  render();
}

let sliderTimer = null;
function onSlide() {
  const value = Number($("slider").value);
  clearTimeout(sliderTimer);
  if (value >= Number($("slider").max)) return goLive();
  sliderTimer = setTimeout(() => scrubTo(value), 120);
  $("slider-label").textContent = formatInstant(value);
}

function placeSlider() {
  const slider = $("slider");
  const now = Math.floor(serverNow() / 1000) * 1000;
  const oldest = state.scrub ? Math.min(state.scrub.at, now - SLIDER_SPAN_MS) : now - SLIDER_SPAN_MS;
  slider.min = String(Math.floor(oldest / 1000) * 1000);
  slider.max = String(now);
  if (document.activeElement !== slider || !state.scrub) slider.value = String(state.scrub ? state.scrub.at : now);
}

// ---- rendering -----------------------------------------------------------------------------------------

function shownLocks() {
  if (state.scrub) {
    return state.scrub.locks.map((lock) => ({ ...lock, left: Date.parse(lock.expires_at) - state.scrub.at }));
  }
  const now = serverNow();
  const locks = [];
  for (const { lock } of state.locks.values()) {
    if (!lock) continue;
    const left = Date.parse(lock.expires_at) - now;
    if (left > 0) locks.push({ ...lock, left });
  }
  return locks.sort((a, b) => (a.resource < b.resource ? -1 : 1));
}

// Everything, after new data; the clock's tick redraws only what time changes (renderLocks, charts).
function render() {
  renderLocks();
  renderSagas();
  renderEvents();
  renderCharts();
  renderMode();
  $("count-sagas").textContent = state.sagas.inFlight.length;
  $("count-stuck").textContent = state.sagas.stuck.length;
}

function renderLocks() {
  renderShared();
  const locks = shownLocks();
  renderHeld(locks);
  renderExpiring(locks);
  renderAgents(locks);
  $("count-held").textContent = locks.length;
  $("count-reservations").textContent = new Set(locks.map((lock) => lock.reservation_id).filter(Boolean)).size;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  node.append(...children);
  return node;
}

// Rows of the held table by resource, kept across redraws: a redraw changes only the cells whose text
// changed, so a selection (copying a resource name) survives the clock's tick.
const heldRows = new Map();

// A lease's time left: a bar that empties and the seconds.
function timeLeft() {
  const fill = el("div", { class: "fill" });
  const secs = el("span", { class: "secs" });
  return { fill, secs, bar: el("div", { class: "time-left" }, el("div", { class: "track" }, fill), secs) };
}

function setTimeLeft(cells, left, ttl) {
  cells.fill.style.width = `${Math.max(0, Math.min(100, (100 * left) / ttl))}%`;
  setText(cells.secs, `${(left / 1000).toFixed(1)} s`);
  cells.bar.toggleAttribute("data-soon", left < EXPIRING_MS);
}

function heldRow(resource) {
  const cells = {
    owner: el("td"),
    token: el("td", { class: "mono" }),
    ...timeLeft(),
    saga: el("td"),
    badge: el("button", { type: "button", class: "badge", hidden: "" }),
    queued: el("td", { class: "queued" }),
  };
  const name = el("td", { class: "mono resource", text: resource, title: `${resource}: click for its queue` });
  name.addEventListener("click", () => openDetail(resource));
  cells.badge.addEventListener("click", () => showReservation(cells.badge.dataset.reservation));
  cells.tr = el(
    "tr",
    { "data-resource": resource },
    name,
    cells.owner,
    cells.token,
    el("td", { class: "left" }, cells.bar),
    cells.saga,
    el("td", { class: "reservation" }, cells.badge),
    cells.queued,
  );
  return cells;
}

// A reservation's hue, the same for every lock of it and on every redraw: its locks read as one group.
function hueOf(id) {
  let hash = 0;
  for (const char of id) hash = (hash * 31 + char.codePointAt(0)) >>> 0;
  return hash % 360;
}

function setReservation(row, id) {
  if (row.badge.dataset.reservation === (id ?? "")) return;
  row.badge.dataset.reservation = id ?? "";
  row.tr.dataset.reservation = id ?? "";
  row.badge.textContent = id ?? "";
  row.badge.title = id ? `Reservation ${id}: show its locks alone` : "";
  row.badge.hidden = !id;
  if (id) row.badge.style.setProperty("--hue", String(hueOf(id)));
}

// The queue's length, from the live list; the past's queues are not recorded (empty while scrubbed).
function setQueued(row, queued) {
  const known = typeof queued === "number";
  setText(row.queued, known && queued > 0 ? String(queued) : "");
  row.queued.dataset.queued = known ? String(queued) : "";
  row.queued.title = known ? `${queued} acquire(s) waiting` : "not known for the past";
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function renderHeld(all) {
  const body = $("held").tBodies[0];
  const only = state.reservation;
  const locks = only ? all.filter((lock) => lock.reservation_id === only) : all;
  $("held-filter").hidden = !only;
  if (only) {
    setText($("held-filter-id"), only);
    setText($("held-filter-count"), `${locks.length} lock(s)`);
  }
  const rows = locks.map((lock) => {
    let row = heldRows.get(lock.resource);
    if (!row) heldRows.set(lock.resource, (row = heldRow(lock.resource)));
    setText(row.owner, lock.owner);
    setText(row.token, String(lock.fencing_token));
    setText(row.saga, lock.saga_id ? `${lock.saga_id} · ${lock.saga_step ?? ""}` : "");
    row.saga.title = row.saga.textContent;
    setReservation(row, lock.reservation_id);
    setQueued(row, lock.queued);
    row.owner.title = lock.owner;
    const ttl = lock.ttl_ms || Date.parse(lock.expires_at) - Date.parse(lock.acquired_at) || lock.left;
    setTimeLeft(row, lock.left, ttl);
    return row.tr;
  });
  const shown = new Set(locks.map((lock) => lock.resource));
  for (const resource of heldRows.keys()) if (!shown.has(resource)) heldRows.delete(resource);
  if (rows.length !== body.children.length || rows.some((tr, i) => body.children[i] !== tr)) {
    body.replaceChildren(...rows);
  }
  $("held-empty").hidden = locks.length > 0;
  $("held-empty").textContent = only
    ? "No lock of this reservation is held."
    : state.scrub
      ? "No lock was held then."
      : "No lock is held.";
}

// Shared-lock grants by resource then token; rows kept across redraws, as the held table's.
const sharedRows = new Map();

// The grants live at the slider's instant, from the replay (by resource then token, as it lists them), each
// its time left then and its length from its acquire.
function scrubbedGrants() {
  const { at, grants } = state.scrub;
  return grants.map((grant) => {
    const left = Date.parse(grant.expires_at) - at;
    return { ...grant, left, ttl_ms: Date.parse(grant.expires_at) - Date.parse(grant.acquired_at) || left };
  });
}

function sharedGrants() {
  const now = serverNow();
  const grants = [];
  for (const { grant } of state.shared.values()) {
    const left = Date.parse(grant.expires_at) - now;
    if (left > 0) grants.push({ ...grant, left });
  }
  const byResource = (a, b) => (a.resource < b.resource ? -1 : a.resource > b.resource ? 1 : 0);
  return grants.sort((a, b) => byResource(a, b) || a.fencing_token - b.fencing_token);
}

// What a grant is: a reader's ("read"), the writer's ("write") or a semaphore's permit (its place among the
// live permits, by token, "of" the limit).
function modeOf(mode, limit) {
  return mode === "exclusive" ? "write" : limit == null ? "read" : "permit";
}

function modeLabel(grant, place) {
  const kind = modeOf(grant.mode, grant.limit);
  return kind === "permit" ? `permit ${place} of ${grant.limit}` : kind;
}

function sharedRow(grant) {
  const cells = { mode: el("span", { class: "mode" }), owner: el("td"), ...timeLeft() };
  const name = el("td", {
    class: "mono resource",
    text: grant.resource,
    title: `${grant.resource}: click for its holders and queue`,
  });
  name.addEventListener("click", () => openDetail(grant.resource, true));
  cells.tr = el(
    "tr",
    { "data-resource": grant.resource, "data-token": String(grant.fencing_token) },
    name,
    el("td", {}, cells.mode),
    cells.owner,
    el("td", { class: "mono", text: String(grant.fencing_token) }),
    el("td", { class: "left" }, cells.bar),
  );
  return cells;
}

// The live grants, or those at the slider's instant.
function renderShared() {
  const grants = state.scrub ? scrubbedGrants() : sharedGrants();
  const places = new Map();
  const rows = grants.map((grant) => {
    const key = grantKey(grant.resource, grant.fencing_token);
    const place = (places.get(grant.resource) ?? 0) + 1;
    places.set(grant.resource, place);
    let row = sharedRows.get(key);
    if (!row) sharedRows.set(key, (row = sharedRow(grant)));
    setText(row.mode, modeLabel(grant, place));
    row.mode.dataset.mode = modeOf(grant.mode, grant.limit);
    setText(row.owner, grant.owner);
    row.owner.title = grant.owner;
    setTimeLeft(row, grant.left, grant.ttl_ms || grant.left);
    return row.tr;
  });
  const shown = new Set(grants.map((grant) => grantKey(grant.resource, grant.fencing_token)));
  for (const key of sharedRows.keys()) if (!shown.has(key)) sharedRows.delete(key);
  const body = $("shared").tBodies[0];
  if (rows.length !== body.children.length || rows.some((tr, i) => body.children[i] !== tr)) {
    body.replaceChildren(...rows);
  }
  $("shared-empty").hidden = rows.length > 0;
  $("shared-empty").textContent = state.scrub ? "No shared lock was held then." : "No shared lock is held.";
  $("shared-note").textContent = state.scrub
    ? "read/write locks and semaphores, then"
    : state.sharedCut
      ? "(the first 1,000)"
      : "read/write locks and semaphores, live";
  $("count-shared").textContent = grants.length;
}

function renderDetail() {
  const detail = state.detail;
  $("detail-card").hidden = !detail;
  if (!detail) return;
  $("detail-card").dataset.resource = detail.resource;
  setText($("detail-resource"), detail.resource);
  if (detail.shared) return renderSharedDetail(detail);
  $("detail-holders-part").hidden = true;
  const lock = detail.lock;
  const facts = lock
    ? [
        ["Status", lock.status],
        ["Holder", lock.status === "held" ? lock.owner : ""],
        ["Token", String(lock.fencing_token)],
        ["Reservation", lock.reservation_id ?? ""],
        ["Saga", lock.saga_id ? `${lock.saga_id} · ${lock.saga_step ?? ""}` : ""],
      ]
    : [["Status", "loading…"]];
  $("detail-facts").replaceChildren(
    ...facts.filter(([, value]) => value).flatMap(([term, value]) => [el("dt", { text: term }), el("dd", { text: value })]),
  );
  renderQueue(lock?.queue ?? [], null);
}

// The queue, first in line first; a shared lock's waiters with their mode (`limit`: the lock's, if any).
function renderQueue(queue, limit) {
  $("detail-queue").replaceChildren(
    ...queue.map((waiting, place) => {
      const mode = waiting.mode ? modeOf(waiting.mode, limit) : null;
      const until = `waits until ${formatClock(Date.parse(waiting.deadline))}`;
      const attrs = { "data-owner": waiting.owner, "data-place": String(place + 1) };
      if (mode) attrs["data-mode"] = mode;
      return el(
        "li",
        attrs,
        el("span", { text: `${place + 1}. ${waiting.owner}` }),
        el("span", { class: "why", text: mode ? `${mode} · ${until}` : until }),
      );
    }),
  );
  $("detail-queue-empty").hidden = queue.length > 0;
}

// A shared lock's detail: what it is, its holders by token (each grant's mode) and its queue.
function renderSharedDetail(detail) {
  const lock = detail.lock;
  const kind = !lock ? "" : lock.limit != null ? `semaphore of ${lock.limit} permits` : "read/write lock";
  const facts = lock
    ? [
        ["Kind", kind],
        ["Holders", String(lock.holders.length)],
      ]
    : [["Status", "loading…"]];
  $("detail-facts").replaceChildren(
    ...facts.flatMap(([term, value]) => [el("dt", { text: term }), el("dd", { text: value })]),
  );
  const holders = lock?.holders ?? [];
  $("detail-holders-part").hidden = false;
  $("detail-holders").replaceChildren(
    ...holders.map((holder, place) => {
      const token = String(holder.fencing_token);
      const mode = modeOf(holder.mode, lock.limit);
      const until = formatClock(Date.parse(holder.expires_at));
      return el(
        "li",
        { "data-owner": holder.owner, "data-token": token, "data-mode": mode },
        el("span", { text: `${modeLabel({ ...holder, limit: lock.limit }, place + 1)} · ${holder.owner}` }),
        el("span", { class: "why", text: `#${token} · until ${until}` }),
      );
    }),
  );
  $("detail-holders-empty").hidden = holders.length > 0;
  renderQueue(lock?.queue ?? [], lock?.limit ?? null);
}

function renderExpiring(locks) {
  const soon = locks.filter((lock) => lock.left < EXPIRING_MS).sort((a, b) => a.left - b.left);
  $("expiring").replaceChildren(
    ...soon.slice(0, 50).map((lock) =>
      el(
        "li",
        { "data-resource": lock.resource },
        el("span", { class: "mono", text: lock.resource }),
        el("span", { class: "why", text: `${lock.owner} · ${(lock.left / 1000).toFixed(1)} s` }),
      ),
    ),
  );
  $("expiring-empty").hidden = soon.length > 0;
}

function renderAgents(locks) {
  const counts = new Map();
  for (const lock of locks) counts.set(lock.owner, (counts.get(lock.owner) || 0) + 1);
  const agents = [...counts].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
  $("agents").replaceChildren(
    ...agents.slice(0, 100).map(([owner, count]) =>
      el(
        "li",
        { "data-owner": owner },
        el("span", { text: owner }),
        el("span", { class: "why", text: agentFigures(owner) }),
        el("b", { text: String(count) }),
      ),
    ),
  );
  $("agents-empty").hidden = agents.length > 0;
  $("count-agents").textContent = agents.length;
}

function currentStep(saga) {
  const step = saga.steps.find((s) => s.status === "running" || s.status === "compensating");
  return step ? `${step.name} (${step.status})` : saga.steps.find((s) => s.status === "pending")?.name ?? "";
}

// The saga's own lease: time left by the server's clock, or the lapse the server recorded (the reaper then
// compensates the saga, or makes it stuck at the second lapse).
function sagaLease(saga) {
  if (saga.lease_lapsed_at) return `lapsed ${formatInstant(Date.parse(saga.lease_lapsed_at))}`;
  if (!saga.lease_expires_at) return "";
  const left = Math.max(0, Date.parse(saga.lease_expires_at) - serverNow());
  return `${(left / 1000).toFixed(1)} s of ${(saga.lease_ms / 1000).toFixed(0)} s`;
}

function renderSagas() {
  $("sagas").tBodies[0].replaceChildren(
    ...state.sagas.inFlight.map((saga) =>
      el(
        "tr",
        { "data-saga": saga.saga_id },
        el("td", { class: "mono", text: saga.saga_id, title: saga.saga_id }),
        el("td", { text: saga.name }),
        el("td", { text: saga.owner }),
        el("td", { text: saga.status }),
        el("td", { text: currentStep(saga) }),
        el("td", { class: saga.lease_lapsed_at ? "lease lapsed" : "lease", text: sagaLease(saga) }),
      ),
    ),
  );
  $("sagas-empty").hidden = state.sagas.inFlight.length > 0;
  $("stuck").replaceChildren(
    ...state.sagas.stuck.map((saga) =>
      el(
        "li",
        { "data-saga": saga.saga_id, class: "stack" },
        el("span", { class: "mono", text: `${saga.saga_id} · ${saga.name} · ${saga.owner}` }),
        el("span", { class: "why", text: saga.reason ?? "" }),
      ),
    ),
  );
  $("stuck-empty").hidden = state.sagas.stuck.length > 0;
}

const KINDS = [
  ["FORCE_RELEASED", "force_released"],
  ["ACQUIRED", "acquired"],
  ["RENEWED", "renewed"],
  ["HANDED_OFF", "handed_off"],
  ["RELEASED", "released"],
  ["EXPIRED", "expired"],
  ["LAPSED", "lapsed"],
  ["STUCK", "stuck"],
  ["FAILED", "failed"],
];
const kindOf = (type) => KINDS.find(([suffix]) => type.endsWith(suffix))?.[1] ?? "other";

function eventRow(at, type, resource, owner, token, extra = {}) {
  return el(
    "li",
    extra,
    el("time", { text: formatClock(at), title: new Date(at).toISOString() }),
    el("span", { class: "type", "data-kind": kindOf(type), text: type }),
    el("span", { class: "mono", text: resource, title: resource }),
    el("span", { text: owner ?? "" }),
    el("span", { class: "mono", text: token == null ? "" : `#${token}` }),
  );
}

function renderEvents() {
  let rows;
  if (state.scrub) {
    const at = state.scrub.at;
    rows = [];
    let marked = false;
    for (const change of state.scrub.changes) {
      const when = Date.parse(change.at);
      if (!marked && when > at) {
        rows.push(el("li", { class: "marker", text: `▲ ${formatInstant(at)}` }));
        marked = true;
      }
      rows.push(
        eventRow(when, change.type, change.resource, change.owner, change.fencing_token, {
          class: when > at ? "after" : "before",
        }),
      );
    }
    if (!marked) rows.push(el("li", { class: "marker", text: `▲ ${formatInstant(at)}` }));
    const { before, after, cut } = state.scrub;
    const span = (ms) => (ms >= 1000 ? `${+(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`);
    $("events-title").textContent =
      before === AROUND_MS && after === AROUND_MS
        ? `Events within ${span(AROUND_MS)} of that instant`
        : `Events ${span(before)} before to ${span(after)} after that instant, the nearest of a busy fleet` +
          (cut ? ` (more than ${HALF_PAGE} within ${span(MIN_AROUND_MS)} before it: the first shown)` : "");
  } else {
    rows = state.events.map((event) =>
      eventRow(Date.parse(event.recorded_at), event.type, event.stream, event.data?.owner, event.data?.fencing_token),
    );
    $("events-title").textContent = "Live events";
  }
  $("events").replaceChildren(...rows);
  $("events-empty").hidden = rows.length > 0;
}

let timeline = null;

function renderMode() {
  const scrubbed = state.scrub !== null;
  timeline?.instantMoved();
  $("banner").hidden = !scrubbed;
  // data-at and data-ready say which instant is shown and whether its answer is in (for scripts, tests).
  $("banner").dataset.at = scrubbed ? new Date(state.scrub.at).toISOString() : "";
  $("banner").dataset.ready = String(Boolean(state.scrub?.ready));
  if (scrubbed) {
    const loading = state.scrub.ready ? "" : " (loading…)";
    $("banner").textContent = `Viewing the fleet at ${formatInstant(state.scrub.at)}${loading}. Sagas and charts stay live.`;
    $("slider-label").textContent = formatInstant(state.scrub.at);
  } else {
    $("slider-label").textContent = "now (live)";
  }
  $("live").disabled = !scrubbed;
  $("held-card").classList.toggle("past", scrubbed);
  if (scrubbed) setFeedStatus("scrubbed");
  else if ($("feed-status").dataset.state === "scrubbed") setFeedStatus("live");
  placeSlider();
}

// ---- charts: bars in inline SVG ------------------------------------------------------------------------

function drawBars(id, values, unit) {
  const card = $(id);
  const svg = card.querySelector("svg");
  const max = Math.max(1, ...values);
  const width = 300 / values.length;
  const bars = values.map((value, i) => {
    const rect = document.createElementNS("http://www.w3.org/2000/svg", "rect");
    const height = (78 * value) / max;
    rect.setAttribute("x", (i * width + 0.5).toFixed(2));
    rect.setAttribute("y", (80 - height).toFixed(2));
    rect.setAttribute("width", Math.max(0.5, width - 1).toFixed(2));
    rect.setAttribute("height", height.toFixed(2));
    return rect;
  });
  svg.replaceChildren(...bars);
  const last = values[values.length - 1] ?? 0;
  card.querySelector(".chart-value").textContent = `${formatRate(last)} ${unit} now · peak ${formatRate(max)}`;
}

function renderCharts() {
  const second = Math.floor(serverNow() / 1000);
  // The last bar is the current second (minute), still filling.
  const grants = Array.from({ length: 60 }, (_, i) => state.grants.get(second - 59 + i) || 0);
  const minute = Math.floor(serverNow() / 60_000);
  const expiries = Array.from({ length: 30 }, (_, i) => state.expiries.get(minute - 29 + i) || 0);
  // One bar per read pair (every 2 s), the newest on the right.
  const conflicts = state.conflicts.map((c) => c.rate);
  drawBars("chart-grants", grants, "/s");
  drawBars("chart-conflicts", [...Array(60 - conflicts.length).fill(0), ...conflicts], "/s");
  drawBars("chart-expiries", expiries, "/min");
  prune(state.grants, second - 120);
  prune(state.expiries, minute - 60);
}

// ---- helpers -------------------------------------------------------------------------------------------

function bump(map, key) {
  map.set(key, (map.get(key) || 0) + 1);
}

function prune(map, oldest) {
  for (const key of map.keys()) if (key < oldest) map.delete(key);
}

const timers = new Map();
function soon(fn, ms) {
  if (timers.has(fn)) return;
  timers.set(
    fn,
    setTimeout(() => {
      timers.delete(fn);
      fn().catch(() => {});
    }, ms),
  );
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const pad = (n, w = 2) => String(n).padStart(w, "0");
const formatClock = (ms) => {
  const d = new Date(ms);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
};
const formatInstant = (ms) => {
  const d = new Date(ms);
  const local = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${formatClock(ms)}`;
  return `${local}.${pad(d.getMilliseconds(), 3)} (${d.toISOString()})`;
};
const formatRate = (value) => (value >= 10 ? value.toFixed(0) : value.toFixed(1));

function setFeedStatus(value) {
  const pill = $("feed-status");
  if (state.scrub && value !== "scrubbed") return;
  pill.dataset.state = value;
  pill.textContent = value === "scrubbed" ? "viewing the past" : value;
}

function tick() {
  $("clock").textContent = formatClock(serverNow());
  if (!state.scrub) renderLocks();
  renderCharts();
  placeSlider();
}

function start() {
  $("token-form").addEventListener("submit", acceptToken);
  $("forget-token").hidden = !sessionStorage.getItem(TOKEN_KEY);
  $("forget-token").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    location.reload();
  });
  const large = new URLSearchParams(location.search).has("large") || localStorage.getItem("lockledger.large") === "1";
  const setLarge = (on) => {
    document.documentElement.classList.toggle("large", on);
    $("large-type").setAttribute("aria-pressed", String(on));
    localStorage.setItem("lockledger.large", on ? "1" : "0");
  };
  setLarge(large);
  $("large-type").addEventListener("click", () => setLarge(!document.documentElement.classList.contains("large")));
  timeline = setUpTimeline({ api, el, now: serverNow, instant: () => state.scrub?.at ?? null });
  $("slider").addEventListener("input", onSlide);
  $("held-filter-clear").addEventListener("click", () => showReservation(null));
  $("detail-close").addEventListener("click", closeDetail);
  $("live").addEventListener("click", goLive);

  const at = Date.parse(new URLSearchParams(location.search).get("at") ?? "");
  every(LOCK_POLL_MS, pollLocks);
  every(LOCK_POLL_MS, pollShared);
  every(SAGA_POLL_MS, pollSagas);
  every(STATS_POLL_MS, pollStats);
  every(STATS_POLL_MS, pollAgentStats);
  followFeed();
  setInterval(tick, 500);
  if (!Number.isNaN(at)) scrubTo(at);
  else render();
  // For scripts and tests: move the view to an instant (ms or RFC 3339), or back to live.
  window.lockledger = { scrubTo: (when) => scrubTo(typeof when === "number" ? when : Date.parse(when)), goLive };
}

start();
