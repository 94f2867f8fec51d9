/**
 * The one place that talks to the server extension (`<base_url>/probing/api/`).
 *
 * Every request goes through `ServerConnection.makeRequest`, so the base URL (also
 * under a JupyterHub prefix), the token and the XSRF cookie come from the server
 * settings. Failures are typed: `ServerGone` when the Jupyter server does not answer
 * at all, `ApiError` (status, code, message) when it answers with an error.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** The route shapes this panel understands; the server says which it serves. */
export const API_VERSION = 2;

export interface IVersion {
  api: number;
  package: string;
  protocol: number;
}

export interface IJob {
  id: string;
  /** Running on the server's machine, added by address, or an ended job read from its dumps (`dump://DIR`). */
  source: 'local' | 'added' | 'dump';
  target: string;
  run_id: string | null;
  endpoint: string | null;
  world_size: number | null;
  pid: number | null;
  host: string | null;
  started: number | null;
  /** false: the job ended; the server still waits for it to be launched again (same id). */
  alive: boolean | null;
  added: number | null;
  /** Relaunches of this job the server saw so far (a panel counts from here when it first meets the job). */
  restarts: number;
  /** The job's TCPStore (`store://host:port/run_id`) when known. */
  store: string | null;
}

/** GET jobs: the jobs the server knows and its clock. */
export interface IJobs {
  jobs: IJob[];
  now: number;
}

export interface IMember {
  rank: number;
  world_size: number;
  local_rank: number;
  local_world_size: number;
  node: number;
  node_count: number;
  host: string;
  endpoint: string;
  pid: number;
  role: string | null;
  /** Random per process start (hex): a relaunched rank has a new one. */
  incarnation: string;
  state: string;
  last_seen: number | null;
  since: number | null;
  step: number | null;
  step_time_ms: number | null;
  compute_ms: number | null;
  comm_wait_ms: number | null;
  tier: string | null;
  /** The rank of its parent in the tree (null: the root, or its parent has not answered yet). */
  parent: number | null;
  /** Its level below the root (the root 0, a broker under the root 1, ...). */
  level: number | null;
  reason: string | null;
  /** The broker that vouched for this rank (null: the rank reported itself). */
  via: number | null;
  // The server's membership view, the same for the CLI, %cluster_nodes and this panel:
  /** step_time_ms / the median over the members that have one (null when unknown). */
  ratio: number | null;
  /** The step-time bar's width, 0..1: the median fills half of it (null when unknown). */
  bar: number | null;
  /** At least 1.5x the median step time. */
  slow: boolean;
  /** The last-seen age as text ("0.4 s", "12 s", "3 min"), at the server's `now`. */
  age: string | null;
  /** How long a stalled or dead rank has been so, as text ("" for an alive one). */
  state_for: string | null;
}

export interface IDeparture {
  rank: number;
  incarnation: string;
  host: string;
  pid: number;
  when: number;
  why: string;
}

export interface ISuspect {
  ranks: number[];
  where: string;
  others: number;
  others_where: string;
  text: string;
}

export interface INodes {
  job_id: string;
  run_id: string | null;
  world_size: number | null;
  /** What the answering probe (or the dumps) said of the job: run id, world size, pid, counts, ... */
  info: { [field: string]: unknown };
  /** The membership's epoch: it moves when a rank joins, leaves or changes who it is. */
  epoch: number | null;
  members: IMember[];
  departures: IDeparture[];
  suspects: ISuspect[];
  /** The server's clock when it answered (epoch seconds): ages are computed against it. */
  now: number;
  /** Relaunches of this job (same run id) the server saw, and the last one's one-line notice. */
  restarts: number;
  restart_notice: string | null;
}

export interface IFrame {
  function: string;
  file: string;
  line: number | null;
  /** Only on a native (C/C++) frame: its file is then the shared object. */
  frame_type?: 'native';
}

export interface IStackGroup {
  ranks: number[];
  label: string;
  thread: string;
  frames: IFrame[];
}

export interface IStacks {
  groups: IStackGroup[];
  ranks: { [rank: string]: IStackGroup };
  /** Which ranks were asked, answered, failed (and why). */
  coverage: { [key: string]: unknown };
  footer: string;
}

/** One finding of the verdict (a row: kind, ranks, group, seq, detail, evidence). */
export interface IFinding {
  kind: string;
  ranks: number[];
  group: string | null;
  seq: number | null;
  detail: string;
  evidence: string;
}

/** GET jobs/<id>/diagnose: why the job is stuck. */
export interface IVerdict {
  /** One plain sentence: the first finding, or "No hang found: ...". */
  summary: string;
  findings: IFinding[];
  checked: string[];
  /** Which ranks answered every query of the verdict. */
  coverage: { [key: string]: unknown };
  healthy: boolean;
  now: number;
}

/** What the Profile button asks: steps from each rank's next step end; ranks "0,2-3" (null: every rank). */
export interface IProfileAsk {
  steps: number;
  ranks: string | null;
}

/** A running capture's last poll of its ranks. */
export interface IProfileProgress {
  finished: number;
  ranks: number;
  running: number;
  /** Ranks armed and waiting for their next step end. */
  armed: number;
  /** Seconds since the capture was asked. */
  waited: number;
}

/**
 * Where a capture the server runs is: the server's PROFILE_STATES, which are kernel_probe's
 * capture states ("armed" shows as running) and "none" before the first (a test checks them).
 */
export type CaptureState = 'none' | 'running' | 'done' | 'failed' | 'cancelled';

/** The merged Chrome/Perfetto trace of a capture, to download (`api.traceUrl`). */
export interface IProfileTrace {
  name: string;
  bytes: number;
  /** What was cut to keep it under its cap ("" when nothing). */
  note: string;
}

export type Cell = string | number | boolean | null;

/** The slowest rank's top ops next to the median rank's: columns op, slowest_ms, median_ms, extra_ms. */
export interface IProfileComparison {
  columns: string[];
  rows: { [column: string]: Cell }[];
}

/** A finished capture's answer. */
export interface IProfileResult {
  capture_id: string;
  ranks: number[];
  steps: number;
  /** Each rank's capture as it reported it (state, steps, events, …). */
  status: { [rank: string]: { [field: string]: Cell } };
  /** Ranks without a profile, and why. */
  failed: { [rank: string]: string };
  slowest_rank: number | null;
  median_rank: number | null;
  comparison: IProfileComparison | null;
  op_rows: number;
  summary: string;
  trace: IProfileTrace | null;
  /** Each rank's clock offset from the root's, applied in the trace. */
  offsets_ms: { [rank: string]: number };
}

/** Why a capture failed: what its start would have answered. */
export interface IProfileError {
  status: number;
  code: string;
  message: string;
}

/** GET/POST/DELETE jobs/<id>/profile: the job's running or last capture. */
export interface IProfileState {
  state: CaptureState;
  job_id: string;
  ranks: number[] | null;
  steps: number | null;
  started: number | null;
  ended: number | null;
  progress: IProfileProgress | null;
  result: IProfileResult | null;
  error: IProfileError | null;
  now: number;
}

/** The Jupyter server did not answer (stopped, restarting, network down). */
export class ServerGone extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ServerGone';
  }
}

/** The server answered with an error status; `code` says what kind. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly line: number | null = null,
    readonly col: number | null = null
  ) {
    super(message);
    this.name = 'ApiError';
  }

  /** The probing routes are not there at all (extension not installed or not enabled). */
  get routeMissing(): boolean {
    return this.status === 404 && this.code === 'no_route';
  }

  /** The job's root is gone (it may be launched again under the same job id). */
  get jobEnded(): boolean {
    return this.code === 'job_ended';
  }

  /** The job did not answer, ended or refused us (502, 503, 504, or its credentials). */
  get jobUnreachable(): boolean {
    return this.status >= 502 || this.code === 'job_refused';
  }
}

async function request<T>(path: string, init: RequestInit = {}, query = ''): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'probing', 'api', path) + query;
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerGone(`the Jupyter server does not answer (${String(error)})`);
  }
  const text = await response.text();
  let body: any = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null; // not ours: e.g. the server's HTML 404 page
  }
  if (!response.ok) {
    if (body === null || typeof body.code !== 'string') {
      const code = response.status === 404 ? 'no_route' : 'http_error';
      throw new ApiError(response.status, code, `${response.status} ${response.statusText} for ${path}`);
    }
    throw new ApiError(response.status, body.code, body.message ?? response.statusText, body.line, body.col);
  }
  return body as T;
}

function jsonPost(body: unknown): RequestInit {
  return { method: 'POST', body: JSON.stringify(body) };
}

/** The server's routes as the panel calls them (a model can be given another, e.g. in tests). */
export type ProbingApi = typeof api;

export const api = {
  version: (): Promise<IVersion> => request<IVersion>('version'),
  jobs: (): Promise<IJobs> => request<IJobs>('jobs'),
  addJob: (target: string, token: string): Promise<IJob> =>
    request<IJob>('jobs', jsonPost({ target, token: token || null })),
  removeJob: (id: string): Promise<void> => request<void>(`jobs/${encodeURIComponent(id)}`, { method: 'DELETE' }),
  nodes: (id: string): Promise<INodes> => request<INodes>(`jobs/${encodeURIComponent(id)}/nodes`),
  stacks: (id: string, ranks?: string): Promise<IStacks> =>
    request<IStacks>(`jobs/${encodeURIComponent(id)}/stacks`, {}, ranks ? `?ranks=${encodeURIComponent(ranks)}` : ''),
  diagnose: (id: string): Promise<IVerdict> => request<IVerdict>(`jobs/${encodeURIComponent(id)}/diagnose`),
  /** Start a capture (the answer comes once its ranks were asked; 409 while one runs). */
  profile: (id: string, ask: IProfileAsk): Promise<IProfileState> =>
    request<IProfileState>(`jobs/${encodeURIComponent(id)}/profile`, jsonPost(ask)),
  profileState: (id: string): Promise<IProfileState> =>
    request<IProfileState>(`jobs/${encodeURIComponent(id)}/profile`),
  cancelProfile: (id: string): Promise<IProfileState> =>
    request<IProfileState>(`jobs/${encodeURIComponent(id)}/profile`, { method: 'DELETE' }),
  /** Where the browser downloads a capture's merged trace (the server's file of that capture). */
  traceUrl: (id: string, captureId: string): string =>
    URLExt.join(
      ServerConnection.makeSettings().baseUrl,
      'probing',
      'api',
      'jobs',
      encodeURIComponent(id),
      'profile',
      'trace'
    ) + `?capture=${encodeURIComponent(captureId)}`
};
