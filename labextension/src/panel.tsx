/**
 * The Cluster panel's views: a toolbar over one React view that re-renders from the
 * model's `changed` signal. Views hold no cluster state of their own (only the text
 * typed into the add-job form).
 */
import { CommandRegistry } from '@lumino/commands';
import { Message } from '@lumino/messaging';
import { Panel, Widget } from '@lumino/widgets';
import { CommandToolbarButton, LabIcon, ReactWidget, SidePanel, UseSignal } from '@jupyterlab/ui-components';
import * as React from 'react';

import { ClusterModel } from './model';
import { IDeparture, IJob, IMember, INodes } from './request';

// three nodes of two ranks; currentColor-free so JupyterLab's icon classes colour it per theme
const clusterSvg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <rect x="2" y="3" width="20" height="5" rx="1"/><rect x="2" y="10" width="20" height="5" rx="1"/>
    <rect x="2" y="17" width="20" height="5" rx="1"/>
  </g>
  <g class="jp-icon-contrast0" fill="#fff">
    <circle cx="6" cy="5.5" r="1.2"/><circle cx="10" cy="5.5" r="1.2"/><circle cx="6" cy="12.5" r="1.2"/>
    <circle cx="10" cy="12.5" r="1.2"/><circle cx="6" cy="19.5" r="1.2"/><circle cx="10" cy="19.5" r="1.2"/>
  </g>
</svg>`;

export const clusterIcon = new LabIcon({ name: 'probing-magics:cluster', svgstr: clusterSvg });

const STATES = ['alive', 'stalled', 'dead'];

/** "0.4 s", "12 s", "3 min", "2 h" */
function age(seconds: number): string {
  if (seconds < 10) {
    return `${Math.max(0, seconds).toFixed(1)} s`;
  }
  if (seconds < 120) {
    return `${Math.round(seconds)} s`;
  }
  if (seconds < 7200) {
    return `${Math.round(seconds / 60)} min`;
  }
  return `${Math.round(seconds / 3600)} h`;
}

/** The last two parts of a path: "testing/tiny_ddp.py". */
function shortPath(file: string): string {
  return file.split('/').slice(-2).join('/');
}

function median(values: number[]): number | null {
  if (values.length === 0) {
    return null;
  }
  const sorted = [...values].sort((a, b) => a - b);
  const mid = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

function jobLabel(job: IJob): string {
  const size = job.world_size === null ? '' : ` · ${job.world_size} ranks`;
  const where = job.source === 'added' ? ` · ${job.target}` : job.host ? ` · ${job.host}` : '';
  const ended = job.alive === false ? ' · ended' : '';
  return `${job.run_id ?? job.id}${size}${where}${ended}`;
}

function JobChooser({ model }: { model: ClusterModel }): JSX.Element | null {
  const job = model.job;
  if (model.jobs.length === 0) {
    return null;
  }
  return (
    <div className="pm-Cluster-jobs">
      <label>
        Job{' '}
        <select
          className="pm-Cluster-jobSelect"
          value={job?.id ?? ''}
          onChange={e => model.choose(e.currentTarget.value)}
        >
          {model.jobs.map(j => (
            <option key={j.id} value={j.id}>
              {jobLabel(j)}
            </option>
          ))}
        </select>
      </label>
      {job?.source === 'added' && (
        <button className="pm-Cluster-linkButton" onClick={() => void model.removeJob(job.id)}>
          forget
        </button>
      )}
    </div>
  );
}

function AddJobForm({ model }: { model: ClusterModel }): JSX.Element {
  const [target, setTarget] = React.useState('');
  const [token, setToken] = React.useState('');
  const [message, setMessage] = React.useState('');
  const [busy, setBusy] = React.useState(false);
  const submit = async (event: React.FormEvent) => {
    event.preventDefault();
    setBusy(true);
    setMessage('');
    try {
      const job = await model.addJob(target.trim(), token);
      setMessage(`added ${job.run_id ?? job.id}`);
      setToken('');
    } catch (error) {
      setMessage(error instanceof Error ? error.message : String(error));
    } finally {
      setBusy(false);
    }
  };
  return (
    <details className="pm-Cluster-add">
      <summary>Add a job by address</summary>
      <form onSubmit={e => void submit(e)}>
        <input
          className="pm-Cluster-addTarget"
          placeholder="tcp://host:port or store://host:port/run_id"
          value={target}
          onChange={e => setTarget(e.currentTarget.value)}
        />
        <input
          className="pm-Cluster-addToken"
          type="password"
          placeholder="token (kept in the server's memory only)"
          autoComplete="off"
          value={token}
          onChange={e => setToken(e.currentTarget.value)}
        />
        <button type="submit" disabled={busy || !target.trim()}>
          Add
        </button>
        {message && <div className="pm-Cluster-addMessage">{message}</div>}
      </form>
    </details>
  );
}

function Summary({ nodes, updated }: { nodes: INodes; updated: Date | null }): JSX.Element {
  const counts = new Map<string, number>();
  for (const m of nodes.members) {
    counts.set(m.state, (counts.get(m.state) ?? 0) + 1);
  }
  const states = [...STATES, ...[...counts.keys()].filter(s => !STATES.includes(s))];
  return (
    <div className="pm-Cluster-summary">
      {states.map(s => (
        <span key={s} className={`pm-Cluster-count pm-state-${s}`} data-state={s}>
          <span className="pm-Cluster-dot" /> {counts.get(s) ?? 0} {s}
        </span>
      ))}
      {nodes.departures.length > 0 && (
        <span className="pm-Cluster-count">{nodes.departures.length} departed</span>
      )}
      <span className="pm-Cluster-updated">updated {updated ? updated.toLocaleTimeString() : '—'}</span>
    </div>
  );
}

function RankRow(props: {
  member: IMember;
  now: number;
  maxMs: number;
  medianMs: number | null;
  suspect: boolean;
  selected: boolean;
  onSelect: () => void;
}): JSX.Element {
  const { member: m, now, maxMs, medianMs, suspect, selected } = props;
  const ms = m.step_time_ms;
  const slow = ms !== null && medianMs !== null && medianMs > 0 && ms > 1.5 * medianMs;
  const width = ms !== null && maxMs > 0 ? Math.max(2, (100 * ms) / maxMs) : 0;
  const classes = ['pm-Cluster-rank', `pm-state-${m.state}`];
  if (suspect) {
    classes.push('pm-suspect');
  }
  if (selected) {
    classes.push('pm-selected');
  }
  return (
    <tr
      className={classes.join(' ')}
      data-rank={m.rank}
      data-state={m.state}
      onClick={props.onSelect}
      title={m.reason ? `${m.state} ${m.reason}` : `${m.state} · pid ${m.pid} · ${m.endpoint}`}
    >
      <td className="pm-Cluster-rankName">
        <span className="pm-Cluster-dot" title={m.state} /> {m.rank}
        {suspect && (
          <span className="pm-Cluster-suspectTag" title="suspect: stuck where the other stalled ranks are not">
            !
          </span>
        )}
      </td>
      <td className="pm-Cluster-role">{m.role ?? ''}</td>
      <td className="pm-Cluster-step">{m.step ?? '—'}</td>
      <td className="pm-Cluster-age">{m.last_seen === null ? '—' : age(now - m.last_seen)}</td>
      <td className="pm-Cluster-time" title={medianMs === null ? '' : `median ${medianMs.toFixed(1)} ms`}>
        <div className="pm-Cluster-barTrack">
          <div className={`pm-Cluster-bar${slow ? ' pm-slow' : ''}`} style={{ width: `${width}%` }} />
        </div>
        <span className="pm-Cluster-ms">{ms === null ? '' : `${ms.toFixed(0)} ms`}</span>
      </td>
    </tr>
  );
}

function Nodes({ model, nodes }: { model: ClusterModel; nodes: INodes }): JSX.Element {
  const times = nodes.members.map(m => m.step_time_ms).filter((t): t is number => t !== null);
  const medianMs = median(times);
  const maxMs = times.length ? Math.max(...times) : 0;
  const suspects = new Set(nodes.suspects.flatMap(s => s.ranks));
  const byNode = new Map<number, IMember[]>();
  for (const m of [...nodes.members].sort((a, b) => a.rank - b.rank)) {
    byNode.set(m.node, [...(byNode.get(m.node) ?? []), m]);
  }
  return (
    <div className="pm-Cluster-nodes">
      {nodes.suspects.map(s => (
        <div key={s.text} className="pm-Cluster-suspect">
          {s.text}
        </div>
      ))}
      {[...byNode.entries()]
        .sort(([a], [b]) => a - b)
        .map(([node, members]) => (
          <div key={node} className="pm-Cluster-node" data-node={node}>
            <div className="pm-Cluster-nodeHeader">
              node {node} · {members[0].host}
            </div>
            <table className="pm-Cluster-table">
              <thead>
                <tr>
                  <th>rank</th>
                  <th>role</th>
                  <th>step</th>
                  <th>seen</th>
                  <th>step time</th>
                </tr>
              </thead>
              <tbody>
                {members.map(m => (
                  <RankRow
                    key={m.rank}
                    member={m}
                    now={nodes.now}
                    maxMs={maxMs}
                    medianMs={medianMs}
                    suspect={suspects.has(m.rank)}
                    selected={model.selectedRank === m.rank}
                    onSelect={() => void model.selectRank(model.selectedRank === m.rank ? null : m.rank)}
                  />
                ))}
              </tbody>
            </table>
          </div>
        ))}
      {nodes.departures.length > 0 && <Departures departures={nodes.departures} now={nodes.now} />}
    </div>
  );
}

function Departures({ departures, now }: { departures: IDeparture[]; now: number }): JSX.Element {
  return (
    <div className="pm-Cluster-departures">
      <div className="pm-Cluster-nodeHeader">departed</div>
      {departures.map(d => (
        <div key={`${d.rank}-${d.incarnation}`} className="pm-Cluster-departure" data-rank={d.rank}>
          rank {d.rank} · {d.why} · {age(now - d.when)} ago · {d.host} pid {d.pid}
        </div>
      ))}
    </div>
  );
}

function Stack({ model }: { model: ClusterModel }): JSX.Element | null {
  if (model.selectedRank === null) {
    return null;
  }
  const stack = model.stack;
  return (
    <div className="pm-Cluster-stack" data-rank={model.selectedRank}>
      <div className="pm-Cluster-stackHeader">
        <span>
          rank {model.selectedRank}
          {stack ? ` · thread ${stack.thread} · innermost first` : ''}
        </span>
        <button className="pm-Cluster-linkButton" onClick={() => void model.selectRank(null)}>
          close
        </button>
      </div>
      {model.stackMessage && <div className="pm-Cluster-stackMessage">{model.stackMessage}</div>}
      {stack && (
        <ol className="pm-Cluster-frames">
          {stack.frames.map((f, i) => (
            <li key={i} className="pm-Cluster-frame" title={`${f.file}:${f.line ?? '?'}`}>
              <span className="pm-Cluster-function">{f.function}</span>{' '}
              <span className="pm-Cluster-file">
                {shortPath(f.file)}:{f.line ?? '?'}
              </span>
            </li>
          ))}
        </ol>
      )}
    </div>
  );
}

function ClusterBody({ model }: { model: ClusterModel }): JSX.Element {
  const nodes = model.nodes;
  const serverOk = !['starting', 'no-extension', 'server-gone'].includes(model.status);
  return (
    <div className="pm-Cluster-body" data-status={model.status}>
      {serverOk && <JobChooser model={model} />}
      {model.status !== 'ready' && (
        <div className={`pm-Cluster-status pm-status-${model.status}`}>{model.message}</div>
      )}
      {serverOk && model.notice && (
        <div className="pm-Cluster-notice">
          <span>{model.notice}</span>{' '}
          <button className="pm-Cluster-linkButton" onClick={() => model.dismissNotice()}>
            dismiss
          </button>
        </div>
      )}
      {nodes && model.status === 'ready' && (
        <>
          <Summary nodes={nodes} updated={model.updated} />
          <Nodes model={model} nodes={nodes} />
          <Stack model={model} />
        </>
      )}
      {serverOk && <AddJobForm model={model} />}
    </div>
  );
}

class ClusterView extends ReactWidget {
  constructor(private readonly _model: ClusterModel) {
    super();
    this.addClass('pm-Cluster-view');
  }

  render(): JSX.Element {
    return <UseSignal signal={this._model.changed}>{() => <ClusterBody model={this._model} />}</UseSignal>;
  }
}

/** The sidebar widget: a header, a toolbar (insert-cell command, refresh) and the view. */
export class ClusterPanel extends SidePanel {
  constructor(readonly model: ClusterModel, commands: CommandRegistry, commandIds: string[]) {
    super({ content: new Panel() }); // a plain panel: the default accordion would add a title row
    this.id = 'probing-cluster';
    this.addClass('pm-Cluster');
    this.title.icon = clusterIcon;
    this.title.caption = 'Cluster';
    const heading = document.createElement('h2');
    heading.textContent = 'Cluster';
    this.header.addWidget(new Widget({ node: heading }));
    for (const id of commandIds) {
      this.toolbar.addItem(id, new CommandToolbarButton({ commands, id, label: '' }));
    }
    this.addWidget(new ClusterView(model));
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this.model.visible = true;
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this.model.visible = false;
  }

  dispose(): void {
    this.model.dispose();
    super.dispose();
  }
}
